"""HTTP for the cache-view tests: completions to fill the cache, GETs that keep their query
string, and an SSE reader."""

from __future__ import annotations

import http.client
import json
from typing import Any, Iterator
from urllib.parse import urlsplit

from tests.server import http as plain
from tests.server.conftest import MODEL
from tests.server.http import Reply

# three prompts with three different first tokens: three top-level prefixes in the tree
KNOWN_PROMPTS = ("Alpha bakes rye bread every morning.", "Bravo sells lemon cakes at noon.",
                 "Charlie fries apple pies on Sundays.")


def complete(server, prompt: str, key: str | None = None, **body) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = plain.post(server.base_url + "/completions", headers=headers,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, **body})
    assert r.status == 200, r.text
    return r.json()


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), target


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> Reply:
    conn, target = _connect(url, timeout)
    try:
        conn.request("GET", target, headers=headers or {})
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


class EventStream:
    """GET a server-sent-events route; `snapshots()` yields each `data:` payload as JSON."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 60.0):
        self.conn, target = _connect(url, timeout)
        self.conn.request("GET", target, headers=headers or {})
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.headers = {k.lower(): v for k, v in self.response.getheaders()}

    def snapshots(self) -> Iterator[Any]:
        while True:
            line = self.response.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                yield json.loads(line[6:])

    def close(self) -> None:
        self.conn.close()
        if self.response.fp is not None:
            self.response.fp.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
