"""`radixserve serve` as a subprocess: it reports where it listens and the pool's size; on
SIGTERM it stops accepting, lets a short request finish, aborts a long one with a clean
abort event, and exits 0 within --shutdown-grace-s; a second signal exits at once.

Every wait is on an event (a line the server prints, a stream event, a refused connect);
the one duration in play is the grace itself: the short request needs 4 decode steps in
it, the long one could not finish 8000 tokens in it on any CPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import http.client

from tests.server import http
from tests.server.conftest import DTYPE, MODEL

GRACE_S = 12.0
LONG_TOKENS = 8000


def start_server(grace_s: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0", "--model", MODEL,
           "--dtype", DTYPE, "--device", "cpu", "--kv-cache-tokens", "10240",
           "--max-model-len", "8192", "--shutdown-grace-s", str(grace_s),
           "--debug-invariants"]          # the engine checks page conservation whenever idle
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    m, _ = read_until(proc, r"on (http://127\.0\.0\.1:(\d+))")
    pool, _ = read_until(proc, r"KV pool: (\d+) tokens .*\((\d+) bytes\)")
    assert int(pool.group(1)) >= 10240 and int(pool.group(2)) > 0
    return proc, m.group(1)


def read_until(proc, pattern: str) -> tuple[re.Match, list[str]]:
    """Lines of the server's output up to one matching `pattern` (fails if it exits first)."""
    seen: list[str] = []
    for line in iter(proc.stdout.readline, ""):
        seen.append(line)
        if m := re.search(pattern, line):
            return m, seen
    raise AssertionError(f"no line matching {pattern!r}; got {seen!r}")


def stream(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    out["events"] = []
    with http.SSEStream(url + "/v1/completions", body, timeout=300) as s:
        out["status"] = s.status
        try:
            for e in s.events():
                out["events"].append(e)
                started.set()
        except (OSError, HTTPException):
            out["cut"] = True               # the server went away mid-stream


def finish_reasons(events: list[str]) -> list[str]:
    return [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])
            if c["finish_reason"]]


def wait_refused(url: str) -> None:
    """Until a new connection is refused (the listener closes right after 'shutting down')."""
    while True:
        try:
            http.get(url + "/health", timeout=30)
        except OSError:
            return


def test_sigterm_drains_within_the_grace_and_exits_zero():
    proc, url = start_server(GRACE_S)
    try:
        assert http.get(url + "/health").status == 200
        short, long_ = {}, {}
        short_started, long_started = threading.Event(), threading.Event()
        threads = [threading.Thread(target=stream, args=(url, 4, short, short_started)),
                   threading.Thread(target=stream, args=(url, LONG_TOKENS, long_, long_started))]
        for t in threads:
            t.start()
        assert short_started.wait(300) and long_started.wait(300)
        proc.send_signal(signal.SIGTERM)
        read_until(proc, r"shutting down")
        wait_refused(url)
        for t in threads:
            t.join(300)
        assert proc.wait(timeout=300) == 0
        assert short["events"][-1] == "[DONE]" and finish_reasons(short["events"]) == ["length"]
        assert long_["events"][-1] == "[DONE]"
        assert finish_reasons(long_["events"]) == ["abort"]           # cut at the grace period
        assert json.loads(long_["events"][-2])["error"]["code"] == "aborted"
        m, _ = read_until(proc, r"stopped \(drain ([\d.]+) s, engine ([\d.]+) s\)")
        assert float(m.group(1)) <= GRACE_S + 0.05      # the drain is bounded by the grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_exits_at_once():
    proc, url = start_server(grace_s=600.0)      # only the second signal can end it early
    try:
        out, started = {}, threading.Event()
        thread = threading.Thread(target=stream, args=(url, LONG_TOKENS, out, started))
        thread.start()
        assert started.wait(300)
        proc.send_signal(signal.SIGTERM)
        read_until(proc, r"shutting down")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 128 + signal.SIGTERM       # the immediate exit's status
        thread.join(300)
        assert "[DONE]" not in out["events"]                          # cut, not drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
