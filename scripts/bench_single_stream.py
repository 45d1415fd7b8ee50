#!/usr/bin/env python
"""One user, one stream: TTFT and decode tok/s of one request at a time, over HTTP.

For each --weights-dtype (and llama.cpp's `llama-server` on the same GGUF when
--llama-server PATH is given), a server is started on a free port, the prompt is sent
once to warm the prefix cache, then --repeats streamed /v1/completions requests of each
--output-tokens length (greedy, ignore_eos) are timed: TTFT = request sent -> first token
chunk (the prompt is cached), decode tok/s = (tokens - 1) / (last chunk - first chunk).
Medians are printed as a markdown table, with ratios against llama.cpp where it ran.

    python scripts/bench_single_stream.py                      # radixserve at each dtype
    python scripts/bench_single_stream.py --llama-server ~/llama.cpp/build/bin/llama-server
    python scripts/bench_single_stream.py --cpu-time --threads 1 --weights-dtypes int4 \
        --llama-server ~/llama.cpp/build/bin/llama-server     # a busy machine: CPU per token

--cpu-time: instead of wall rates, each server's CPU time per decoded token (its processes'
user + system time over a long request minus a short one, so prompt and request overhead
cancel), both sides with --threads compute threads (radixserve through OMP_NUM_THREADS).
Other processes barely move it, so it compares the two servers' work on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from bench_startup import ROOT, free_port, health, stop_server

PROMPT = ("You are a helpful assistant. Explain, step by step, how a radix tree stores "
          "strings that share prefixes, and why that helps a language model server.")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights-dtypes", default="auto,bf16,int8,int4,int4+float")
    p.add_argument("--output-tokens", default="128,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--decode-compile", default="off",
                   help="comma-separated --decode-compile modes to run each dtype with "
                        "(e.g. off,on: the eager and the compiled lone decode side by side; "
                        "a mode other than off waits until the server's compiled step is "
                        "ready, compiling it first on a cold cache)")
    p.add_argument("--quick", action="store_true", help="auto only, 16 tokens, 1 repeat")
    p.add_argument("--cpu-time", action="store_true",
                   help="CPU time per decoded token instead of wall rates (module docstring)")
    args = p.parse_args()
    if args.quick:
        args.weights_dtypes, args.output_tokens, args.repeats = "auto", "16", 1
    return args


def start(cmd: list[str], url: str, timeout: float,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    t0 = time.monotonic()
    while health(url) != 200:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with {proc.returncode}:\n{proc.stdout.read()}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise SystemExit(f"no 200 on {url}/health after {timeout} s")
        time.sleep(0.05)
    return proc


def stream(url: str, model: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, chunks with text) of one streamed greedy completion."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if any(c.get("text") for c in json.loads(line[5:]).get("choices", [])):
                stamps.append(time.perf_counter())
    rate = (max_tokens - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return stamps[0] - t0, rate, len(stamps)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (/proc)."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                children = open(f"/proc/{p}/task/{task}/children").read().split()
                todo += [int(c) for c in children]
        except OSError:
            continue
    return total


def cpu_per_token(proc: subprocess.Popen, url: str, args) -> float:
    """CPU seconds per decoded token: (long request - short request) / token difference,
    median over --repeats pairs (the prompt is cached; its cost and the request's cancel)."""
    short, long_ = 16, max(map(int, args.output_tokens.split(",")))
    per = []
    for _ in range(args.repeats):
        c0 = tree_cpu_seconds(proc.pid)
        stream(url, args.model, short)
        c1 = tree_cpu_seconds(proc.pid)
        stream(url, args.model, long_)
        c2 = tree_cpu_seconds(proc.pid)
        per.append(((c2 - c1) - (c1 - c0)) / (long_ - short))
    return statistics.median(per)


def wait_compiled(proc: subprocess.Popen, url: str, args) -> None:
    """Until the server logs that its lone decode runs compiled. On a cold cache the
    compile's end is noticed at a lone decode step, so short requests keep coming."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        stream(url, args.model, 2)
        try:
            line = lines.get(timeout=5)
        except queue.Empty:
            continue
        if "now runs compiled" in line:
            return
        if "eager step stays" in line:
            raise SystemExit(f"no compiled step: {line}")
    raise SystemExit(f"no compiled step after {args.timeout} s")


def measure(name: str, cmd: list[str], url: str, args,
            env: dict[str, str] | None = None) -> dict[int, tuple[float, float]]:
    proc = start(cmd, url, args.timeout, env)
    try:
        if "--decode-compile" in cmd and cmd[cmd.index("--decode-compile") + 1] != "off":
            wait_compiled(proc, url, args)
        if args.cpu_time:
            stream(url, args.model, 4)
            ms = cpu_per_token(proc, url, args) * 1e3
            print(f"  {name}: {ms:.2f} ms CPU per decoded token", flush=True)
            return {0: (float("nan"), 1e3 / ms)}     # tokens per CPU-second
        stream(url, args.model, 4)                    # warm: the prompt enters the cache
        out = {}
        for n in map(int, args.output_tokens.split(",")):
            runs = [stream(url, args.model, n) for _ in range(args.repeats)]
            out[n] = (statistics.median(r[0] for r in runs),
                      statistics.median(r[1] for r in runs))
            print(f"  {name}, {n} tokens: TTFT {out[n][0] * 1e3:.0f} ms, decode "
                  f"{out[n][1]:.1f} tok/s", flush=True)
        return out
    finally:
        stop_server(proc)


def main() -> None:
    args = parse_args()
    results: dict[str, dict[int, tuple[float, float]]] = {}
    if args.llama_server:
        from radixserve.model.registry import resolve_model_path
        gguf = str(resolve_model_path(args.model))
        port = free_port()
        results["llama.cpp"] = measure(
            "llama.cpp", [args.llama_server, "-m", gguf, "--port", str(port), "-t",
                          str(args.threads), "-np", "1", "-c", "4096"],
            f"http://127.0.0.1:{port}", args)
    for wd in args.weights_dtypes.split(","):
        for mode in args.decode_compile.split(","):
            port = free_port()
            name = f"radixserve {wd}" + (f", decode-compile {mode}" if mode != "off" else "")
            results[name] = measure(
                name, [sys.executable, "-m", "radixserve.cli", "serve", "--port",
                       str(port), "--model", args.model, "--weights-dtype", wd,
                       "--decode-compile", mode],
                f"http://127.0.0.1:{port}", args,
                {"OMP_NUM_THREADS": str(args.threads)} if args.cpu_time else None)
    base = results.get("llama.cpp")
    if args.cpu_time:
        print("\n| server | compute threads | CPU ms per decoded token | vs llama.cpp |")
        print("|---|---|---|---|")
        for name, per_n in results.items():
            rate = per_n[0][1]
            ratio = f"{rate / base[0][1]:.2f}x" if base else "-"
            print(f"| {name} | {args.threads} | {1e3 / rate:.2f} | {ratio} |")
        return
    print("\n| server | output tokens | TTFT (cached prompt) | decode tok/s | vs llama.cpp |")
    print("|---|---|---|---|---|")
    for name, per_n in results.items():
        for n, (ttft, rate) in per_n.items():
            ratio = f"{rate / base[n][1]:.2f}x" if base else "-"
            print(f"| {name} | {n} | {ttft * 1e3:.0f} ms | {rate:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
