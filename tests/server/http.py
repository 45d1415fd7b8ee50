"""Plain HTTP for tests (stdlib http.client): exact status codes, headers, raw bodies, and
streams the test can walk away from mid-way."""

from __future__ import annotations

import http.client
import json as _json
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return _json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def request(method: str, url: str, json: Any = None, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60.0,
            content_type: str | None = "application/json") -> Reply:
    """One request; a POST says its body is JSON unless `content_type` says otherwise
    (None: no Content-Type header at all)."""
    conn, path = _conn(url, timeout)
    hdrs = dict(headers or {})
    if json is not None:
        body = _json.dumps(json).encode()
    if method == "POST" and content_type is not None:
        hdrs.setdefault("Content-Type", content_type)
    try:
        try:
            conn.request(method, path, body=body, headers=hdrs)
        except (BrokenPipeError, ConnectionResetError):
            pass    # the server answered early and closed (a 413): read it, as httpx does
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def get(url: str, **kw) -> Reply:
    return request("GET", url, **kw)


def post(url: str, json: Any = None, **kw) -> Reply:
    return request("POST", url, json=json, **kw)


class SSEStream:
    """A streaming POST; iterate `events()` for the `data:` payloads, `close()` to hang up."""

    def __init__(self, url: str, json: Any, headers: dict[str, str] | None = None,
                 timeout: float = 60.0):
        self.conn, path = _conn(url, timeout)
        self.conn.request("POST", path, body=_json.dumps(json).encode(),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.response = self.conn.getresponse()
        self.status = self.response.status

    def events(self) -> Iterator[str]:
        while True:
            line = self.response.readline()
            if not line:
                return
            line = line.strip()
            if line.startswith(b"data: "):
                yield line[6:].decode()

    def close(self) -> None:
        self.conn.close()
        if self.response.fp is not None:     # drop the socket now, not at garbage collection
            self.response.fp.close()

    def __enter__(self) -> "SSEStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
