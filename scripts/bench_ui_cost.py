#!/usr/bin/env python3
"""What an open cache view costs the engine: bench_serving.py's workload with and without a
client that polls like the page, on one server, runs interleaved (A B B A ...) so drift and
other load hit both sides alike.

The page-like client reads `GET /cache/events` (one snapshot a second) and fetches
`GET /cache/tree?limit=200` whenever the counters say the tree changed, at most every 1.5 s:
what radixserve/server/ui/app.js does. Prints requests/s of each run, the medians, their
ratio, and the /cache/tree latency the client saw.

  python scripts/bench_ui_cost.py                 # starts its own server on the default model
  python scripts/bench_ui_cost.py --pairs 5 --groups 8 --prompts-per-group 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

import bench_serving as bs
from ui_server import running_server

TREE_MIN_GAP_S = 1.5


async def page_like_client(url: str, tree_latency: list[float], snapshots: list[int]) -> None:
    """Poll like an open page until cancelled."""
    last_sig, last_fetch = None, 0.0
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/cache/events?interval=1") as events:
            async for line in events.content:
                if not line.startswith(b"data: "):
                    continue
                snap = json.loads(line[6:])
                snapshots[0] += 1
                sig = (snap["cache"]["nodes"], snap["cache"]["cached_tokens"],
                       snap["prefix_cache"]["query_tokens"], snap["prefix_cache"]["hit_tokens"])
                if sig != last_sig and time.monotonic() - last_fetch >= TREE_MIN_GAP_S:
                    t0 = time.perf_counter()
                    async with session.get(url + "/cache/tree?limit=200") as tree:
                        await tree.read()
                    tree_latency.append(time.perf_counter() - t0)
                    last_sig, last_fetch = sig, time.monotonic()


async def one_run(url: str, workload: list, with_page: bool, tree_latency: list[float],
                  max_concurrency: int) -> tuple[float, int]:
    snapshots = [0]
    poller = (asyncio.create_task(page_like_client(url, tree_latency, snapshots))
              if with_page else None)
    try:
        cfg = bs.ClientConfig(url, None)
        run = await bs.run_workload(cfg, workload, bs.RunOptions(max_concurrency=max_concurrency,
                                                                 warmup=0), progress=False)
    finally:
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    s = bs.summarize(run)
    if s["failed"]:
        raise SystemExit(f"{s['failed']} requests failed: {s['errors']}")
    return s["request_throughput"], snapshots[0]


async def measure(url: str, args) -> None:
    sizes = bs.Sizes(groups=args.groups, prompts_per_group=args.prompts_per_group,
                     system_len=args.system_prompt_len, question_len=args.question_len,
                     output_len=args.output_len)
    workload = bs.shared_prefix_workload(sizes, seed=0)
    await one_run(url, workload[:4], False, [], args.max_concurrency)     # warm-up, unmeasured
    rates: dict[bool, list[float]] = {False: [], True: []}
    tree_latency: list[float] = []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for with_page in order:
            rate, snaps = await one_run(url, workload, with_page, tree_latency,
                                        args.max_concurrency)
            rates[with_page].append(rate)
            label = f"with page ({snaps} snapshots)" if with_page else "without page"
            print(f"pair {pair + 1} {label:28s} {rate:7.3f} req/s", flush=True)
    base, page = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"\nworkload: shared-prefix, {len(workload)} requests, {sizes}")
    print(f"median requests/s  without page {base:.3f}   with page {page:.3f}   "
          f"ratio {page / base:.4f} ({100 * (page / base - 1):+.2f}%)")
    if tree_latency:
        print(f"/cache/tree?limit=200 latency seen by the client: median "
              f"{1e3 * statistics.median(tree_latency):.1f} ms, max {1e3 * max(tree_latency):.1f} ms "
              f"over {len(tree_latency)} fetches")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4)
    args = p.parse_args()
    if args.url:
        asyncio.run(measure(args.url, args))
    else:
        with running_server([]) as url:
            asyncio.run(measure(url, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
