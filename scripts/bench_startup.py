"""Cold starts of `radixserve serve`: time from spawning the process to a 200 on /health.

Each start is a new process on a free 127.0.0.1 port. The script polls /health every
20 ms from the moment it spawns the server, records when it first answers (503: listening,
warming up) and when it answers 200, then reads the server's own phase line ("ready in ...:
python and imports 1.0 s, ...") and, with --first-request, times one completion request.
Prints each start and the medians.

    python scripts/bench_startup.py                       # 5 starts of the default model
    python scripts/bench_startup.py --runs 5 --first-request \\
        --variant default= --variant no-warmup="--warmup-tokens 0"

Variants run interleaved (A B A B ...), so machine load hits them alike. The weights
cache is primed by one unmeasured start first (--no-prime to measure a miss too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = re.compile(r"ready in ([\d.]+) s: (.*?)(?: \((.*)\))?$")
PHASE = re.compile(r"(.+?) ([\d.]+) s")
FIRST_PROMPT = [{"role": "user", "content": "Write a short poem about the sea, in four lines."}]


@dataclass
class Start:
    variant: str
    to_listen_s: float | None = None       # first HTTP answer (503 while warming up)
    to_ready_s: float = 0.0                # first 200 on /health
    server_total_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    first_request_s: float | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def first_request(url: str, max_tokens: int) -> float:
    body = json.dumps({"model": "x", "messages": FIRST_PROMPT, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - t0


def one_start(variant: str, server_args: list[str], opts) -> Start:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *server_args]
    result = Start(variant)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while True:
            status = health(url)
            now = time.perf_counter() - t0
            if status is not None and result.to_listen_s is None:
                result.to_listen_s = now
            if status == 200:
                result.to_ready_s = now
                break
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
            if now > opts.timeout:
                raise SystemExit(f"no 200 on /health after {opts.timeout} s")
            time.sleep(0.02)
        for line in proc.stdout:
            if m := READY_LINE.search(line.strip()):
                result.server_total_s = float(m.group(1))
                result.phases = {p.group(1).strip(", "): float(p.group(2))
                                 for p in PHASE.finditer(m.group(2))}
                result.notes = m.group(3) or ""
                break
        if opts.first_request:
            result.first_request_s = first_request(url, opts.max_tokens)
    finally:
        stop_server(proc)
    return result


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def describe(s: Start) -> str:
    phases = ", ".join(f"{k} {v:.2f}" for k, v in s.phases.items())
    first = f", first request {s.first_request_s:.2f} s" if s.first_request_s is not None else ""
    return (f"[{s.variant}] /health 200 after {s.to_ready_s:.2f} s (listening at "
            f"{s.to_listen_s:.2f} s; server says {s.server_total_s:.2f} s: {phases})"
            f"{first} {s.notes}")


def report(starts: list[Start]) -> None:
    for variant in dict.fromkeys(s.variant for s in starts):
        runs = [s for s in starts if s.variant == variant]
        med = statistics.median
        print(f"\n== {variant}: {len(runs)} starts ==")
        print(f"median spawn -> /health 200: {med(s.to_ready_s for s in runs):.2f} s "
              f"(min {min(s.to_ready_s for s in runs):.2f}, max "
              f"{max(s.to_ready_s for s in runs):.2f})")
        names = list(dict.fromkeys(k for s in runs for k in s.phases))
        for name in names:
            print(f"  {name:<22} {med(s.phases.get(name, 0.0) for s in runs):6.2f} s")
        if all(s.first_request_s is not None for s in runs):
            print(f"median first request: {med(s.first_request_s for s in runs):.2f} s; "
                  f"ready + first request: "
                  f"{med(s.to_ready_s + s.first_request_s for s in runs):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="measured starts per variant")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="extra `serve` arguments under a name (repeat to compare)")
    ap.add_argument("--first-request", action="store_true",
                    help="also time one chat completion right after /health says 200")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-prime", action="store_true",
                    help="measure from the first start (a cold weights cache included)")
    ap.add_argument("--timeout", type=float, default=300.0)
    opts = ap.parse_args()
    variants = [v.split("=", 1) for v in opts.variant] or [["default", ""]]
    variants = [(name, shlex.split(args)) for name, args in variants]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} "
          f"(1 min) at the start", flush=True)
    if not opts.no_prime:
        print("[prime] " + describe(one_start("prime", variants[0][1], opts)), flush=True)
    starts = []
    for _ in range(opts.runs):
        for name, args in variants:
            starts.append(one_start(name, args, opts))
            print(describe(starts[-1]), flush=True)
    report(starts)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
