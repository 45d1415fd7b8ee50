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
    p.add_argument("--quick", action="store_true", help="auto only, 16 tokens, 1 repeat")
    args = p.parse_args()
    if args.quick:
        args.weights_dtypes, args.output_tokens, args.repeats = "auto", "16", 1
    return args


def start(cmd: list[str], url: str, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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


def measure(name: str, cmd: list[str], url: str, args) -> dict[int, tuple[float, float]]:
    proc = start(cmd, url, args.timeout)
    try:
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
        port = free_port()
        results[f"radixserve {wd}"] = measure(
            f"radixserve {wd}", [sys.executable, "-m", "radixserve.cli", "serve", "--port",
                                 str(port), "--model", args.model, "--weights-dtype", wd],
            f"http://127.0.0.1:{port}", args)
    base = results.get("llama.cpp")
    print("\n| server | output tokens | TTFT (cached prompt) | decode tok/s | vs llama.cpp |")
    print("|---|---|---|---|---|")
    for name, per_n in results.items():
        for n, (ttft, rate) in per_n.items():
            ratio = f"{rate / base[n][1]:.2f}x" if base else "-"
            print(f"| {name} | {n} | {ttft * 1e3:.0f} ms | {rate:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
