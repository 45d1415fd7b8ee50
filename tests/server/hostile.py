"""Hostile clients and a probe stream, shared by the hostile-input test and
scripts/bench_hostile.py. Loopback only; every request is bounded by the server's own
timeouts (the client's socket timeouts are only a backstop)."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from radixserve.server.body_limit import BodyLimit
from tests.server import http

CHAT = "/v1/chat/completions"
HELD = b"(client timeout: the server held the connection)"
MSG = [{"role": "user", "content": "hi"}]


def nested(depth: int, open_: str, close: str) -> bytes:
    return (open_ * depth + close * depth).encode()


@dataclass
class Outcome:
    name: str
    status: int | None              # None: the server closed the connection without a reply
    body: bytes = b""
    seconds: float = 0.0

    def error(self) -> dict | None:
        try:
            return json.loads(self.body)["error"]
        except (ValueError, KeyError, TypeError):
            return None


def read_until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it closes (or resets) the connection; a socket timeout
    is left to the caller."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise
    except OSError:
        pass
    return data


def _raw_with_timeout(url: str, payload: bytes, *, head: bytes = b"", trickle_s: float = 0.0,
         keep_open_s: float = 120.0, half_close: bool = False) -> tuple[int | None, bytes]:
    """Send `head` at once, then `payload` (one byte every `trickle_s` if set); the reply's
    status and body, or (None, b'') when the server closes without one."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=keep_open_s) as sock:
        try:
            sock.sendall(head)
            if trickle_s:
                for b in payload:
                    if select.select([sock], [], [], 0)[0]:
                        break       # the server answered: read it before our writes reset it
                    sock.sendall(bytes([b]))
                    time.sleep(trickle_s)
            else:
                sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass                    # the server answered (and closed) before we were done
        try:
            data = read_until_closed(sock)
        except TimeoutError:
            return None, HELD
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _post_head(path: str, length: int, content_type: str = "application/json",
               headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"{extra}Content-Length: {length}\r\n\r\n").encode()


@dataclass
class HostileCase:
    name: str
    run: Callable[[str], tuple[int | None, bytes]]
    expect: int | None              # the status; None: closed without a reply


def _post_with_timeout(path: str, body: bytes, content_type: str | None = "application/json",
                       timeout_s: float = 120.0, headers: dict[str, str] | None = None):
    def run(url: str) -> tuple[int | None, bytes]:
        try:
            r = http.post(url + path, body=body, content_type=content_type, timeout=timeout_s,
                          headers=headers)
        except TimeoutError:            # held past the client's patience
            return None, HELD
        except OSError as exc:          # reset
            return None, repr(exc).encode()
        return r.status, r.body
    return run


# The default limit (--max-body-bytes auto) of the servers the test and the benchmark run
# (--max-model-len 2048): 1.125 MiB. The 5 MB prompt, 200,000 messages and 17 stop strings
# of 450 KB are over it (413, by their declared length); the 1 MB stop string is not (400).
SERVED_CONTEXT = 2048


def hostile_cases(client_timeout_s: float = 120.0, headers: dict[str, str] | None = None,
                  body_limit: int | None = None) -> list[HostileCase]:
    """The mix of issue 20: each case's request is built once, here, not while measuring.
    `client_timeout_s` only bounds how long a client waits (for servers without timeouts);
    `headers` (an API key) go with every case whose headers are complete; a body over
    `body_limit` (default: the auto limit at SERVED_CONTEXT) expects 413."""
    limit = body_limit or BodyLimit.resolve(None, SERVED_CONTEXT).bytes

    def post(path: str, body: bytes, content_type: str | None = "application/json"):
        return _post_with_timeout(path, body, content_type, client_timeout_s, headers)

    def refused(name: str, path: str, body: bytes, status: int = 400) -> HostileCase:
        return HostileCase(name, post(path, body), 413 if len(body) > limit else status)

    def head(length: int) -> bytes:
        return _post_head(CHAT, length, headers=headers)

    def raw(url: str, payload: bytes, **kw) -> tuple[int | None, bytes]:
        return _raw_with_timeout(url, payload, keep_open_s=client_timeout_s, **kw)

    chat = lambda **kw: json.dumps({"messages": MSG, **kw}).encode()        # noqa: E731
    big_prompt = json.dumps({"prompt": "word " * (1024 * 1024), "max_tokens": 4}).encode()
    many_messages = json.dumps({"messages": [{"role": "user", "content": "x"}] * 200_000}).encode()
    deep_field = b'{"messages": [{"role": "user", "content": "x"}], "extra": ' + \
        nested(10_000, "[", "]") + b"}"
    deep_tools = b'{"messages": [{"role": "user", "content": "x"}], "tools": [' + \
        nested(10_000, '{"a":', "}").replace(b"}", b"") + b"1" + b"}" * 10_000 + b"]}"
    deep_generate = b'{"text": "x", "sampling_params": ' + nested(10_000, "[", "]") + b"}"
    slow = chat(max_tokens=2)
    cases = [
        HostileCase("nested arrays (10,000 levels)", post(CHAT, deep_field), 400),
        HostileCase("nested objects in tools (10,000)", post(CHAT, deep_tools), 400),
        HostileCase("nested arrays on /generate", post("/generate", deep_generate), 400),
        refused("5 MB prompt", "/v1/completions", big_prompt),
        refused("200,000 messages", CHAT, many_messages),
        HostileCase("invalid UTF-8", post(CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400),
        HostileCase("n 1000", post(CHAT, chat(n=1000)), 400),
        HostileCase("max_tokens 10^9", post(CHAT, chat(max_tokens=10**9)), 400),
        HostileCase("logprobs 10^6", post("/v1/completions",
                                           json.dumps({"prompt": "x", "logprobs": 10**6}).encode()), 400),
        HostileCase("top_logprobs 10^6", post(CHAT, chat(logprobs=True, top_logprobs=10**6)), 400),
        HostileCase("10,000 stop strings", post(CHAT, chat(stop=[f"s{i}" for i in range(10_000)])), 400),
        refused("17 stop strings of 450 KB", CHAT, chat(stop=["y" * 450_000] * 17)),
        refused("1 MB stop string", CHAT, chat(stop="z" * 1_000_000)),
        HostileCase("text/plain body", post(CHAT, chat(), "text/plain"), 415),
        HostileCase("form-encoded body", post(CHAT, b"messages=hi", "application/x-www-form-urlencoded"), 415),
        HostileCase("no content type", post(CHAT, chat(), None), 415),
        HostileCase("slow body (1 byte / 100 ms)",
                    lambda url: raw(url, slow, head=head(len(slow)), trickle_s=0.1),
                    408),
        HostileCase("slow headers (1 byte / 100 ms)",
                    lambda url: raw(url, head(len(slow)) + slow, trickle_s=0.1),
                    None),
        HostileCase("incomplete body, then silence",
                    lambda url: raw(url, head(1000) + b'{"messages": ['), 408),
        HostileCase("incomplete body, then half-close",
                    lambda url: raw(url, head(1000) + b'{"messages": [',
                                     half_close=True), None),
        HostileCase("incomplete headers, then silence",
                    lambda url: raw(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"), None),
    ]
    return cases


def run_case(url: str, case: HostileCase) -> Outcome:
    t0 = time.monotonic()
    status, body = case.run(url)
    return Outcome(case.name, status, body, time.monotonic() - t0)


def open_idle_connections(url: str, count: int, keep_open_s: float = 120.0) -> list[Outcome]:
    """`count` connections opened at once, sending nothing: what each one gets back."""
    parts = urlsplit(url)
    socks = [socket.create_connection((parts.hostname, parts.port), timeout=keep_open_s)
             for _ in range(count)]
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    for sock in socks:
        try:
            data = read_until_closed(sock)
        except OSError:
            data = b""
        sock.close()
        status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
        outcomes.append(Outcome("idle connection", status, data.partition(b"\r\n\r\n")[2],
                                time.monotonic() - t0))
    return outcomes


@dataclass
class Probe:
    """Streams chat completions back to back until stopped, timing the gaps between chunks
    (the first chunk of each stream, which waits for the prefill, is not a gap)."""

    url: str
    max_tokens: int = 48
    headers: dict[str, str] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    streams: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    streamed: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "Probe":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(300)

    @property
    def longest_gap(self) -> float:
        return max(self.gaps, default=0.0)

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": "Tell me about bread."}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        while not self._stop.is_set():
            try:
                with http.SSEStream(self.url + CHAT, body, headers=self.headers, timeout=120) as s:
                    if s.status != 200:
                        self.failures.append(f"status {s.status}")
                        continue
                    last = None
                    for _ in s.events():
                        now = time.monotonic()
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now
                self.streams += 1
                self.streamed.set()
            except OSError as exc:
                self.failures.append(repr(exc))


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def stop_server(proc) -> None:
    """SIGTERM a server subprocess (it drains and saves), SIGKILL it after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
