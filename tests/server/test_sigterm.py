"""`radixserve serve` as a subprocess: it reports where it listens and the pool's size, and on
SIGTERM stops accepting, lets short requests finish, aborts long ones, and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.server import http
from tests.server.conftest import DTYPE, MODEL

GRACE_S = 3.0


def read_until(proc, pattern: str, timeout: float = 240.0) -> tuple[re.Match, list[str]]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            return m, seen
    raise AssertionError(f"no line matching {pattern!r}; got {seen!r}")


def stream(url: str, max_tokens: int, out: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with http.SSEStream(url + "/v1/completions", body, timeout=120) as s:
        out["status"] = s.status
        out["events"] = []
        for e in s.events():
            out["events"].append(e)
            out.setdefault("first", time.monotonic())


def test_sigterm_drains_and_exits_zero():
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0", "--model", MODEL,
           "--dtype", DTYPE, "--device", "cpu", "--kv-cache-tokens", "8192",
           "--max-model-len", "2048", "--shutdown-grace-s", str(GRACE_S),
           "--debug-invariants"]          # the engine checks page conservation whenever idle
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        m, _ = read_until(proc, r"on (http://127\.0\.0\.1:(\d+))")
        url = m.group(1)
        pool, _ = read_until(proc, r"KV pool: (\d+) tokens .*\((\d+) bytes\)", timeout=5)
        assert int(pool.group(1)) >= 8192 and int(pool.group(2)) > 0
        assert http.get(url + "/health").status == 200

        short, long_ = {}, {}
        threads = [threading.Thread(target=stream, args=(url, 12, short)),
                   threading.Thread(target=stream, args=(url, 1900, long_))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not ("first" in short and "first" in long_) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "first" in short and "first" in long_
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(OSError):               # no longer accepting connections
            http.get(url + "/health", timeout=2)
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0
        elapsed = time.monotonic() - t_signal
        assert elapsed < GRACE_S + 15

        def finish_reasons(events):
            return [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])
                    if c["finish_reason"]]
        assert short["events"][-1] == "[DONE]" and finish_reasons(short["events"]) == ["length"]
        assert long_["events"][-1] == "[DONE]"
        assert finish_reasons(long_["events"]) == ["abort"]           # cut at the grace period
        assert json.loads(long_["events"][-2])["error"]["code"] == "aborted"
        rest = proc.stdout.read()
        assert "shutting down" in rest and "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
