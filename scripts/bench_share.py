"""Load vs recompute: TTFT of a long prefix a peer computed, loaded through each cluster store
(--kv-share dir, ray), against computing it again. Side by side in one run, alternating.

Engine A computes the prompt once and publishes its pages. Then, per round and per store,
two fresh-cache engines serve the same prompt: one without sharing (it computes the prefix)
and one with the store (it loads the prefix and computes the last page's tokens). Each
round flushes both caches first; the arms alternate so that machine load hits both alike.
Reported per arm: TTFT p50 (wall) and the process CPU time per request, and how many of the
sharing engine's requests really loaded (it stops loading when its measured load cost per
token is above its compute cost: engine/tier_costs.py).

  python scripts/bench_share.py                      # 2,048-token prefix, dir and ray
  python scripts/bench_share.py --stores dir --tokens 1024 --rounds 3

Both engines run in this process (one compute thread); with `ray` the store is a local Ray
cluster's object store and directory actor, so the load is a same-node object read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.engine.config import EngineConfig            # noqa: E402
from radixserve.engine.engine import Engine                  # noqa: E402
from radixserve.engine.sampling_params import SamplingParams  # noqa: E402
from radixserve.model import load_model                      # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def make_engine(loaded, tokens: int, share: str) -> Engine:
    return Engine(EngineConfig(kv_cache_tokens=4 * tokens, chunked_prefill_size=tokens + 64,
                               warmup_tokens=0, kv_share=share), loaded)


async def timed_request(engine: Engine, prompt: list[int]) -> tuple[float, float, int]:
    """(TTFT seconds, process CPU seconds, prompt tokens served from the cache)."""
    cpu, started = time.process_time(), time.perf_counter()
    ttft, cached = None, 0
    async for out in engine.generate(prompt, ONE_TOKEN):
        if ttft is None and out.token_ids:
            ttft = time.perf_counter() - started
        if out.finished:
            cached = out.usage.cached_tokens
    return ttft, time.process_time() - cpu, cached


async def bench_store(loaded, store: str, spec: str, prompt: list[int], rounds: int) -> dict:
    tokens = len(prompt)
    publisher = make_engine(loaded, tokens, spec)
    await publisher.start()
    await timed_request(publisher, prompt)
    while publisher.scheduler.has_work():          # the publish order's step
        await asyncio.sleep(0.01)
    await publisher.share_published()
    await publisher.shutdown()
    arms = {"recompute": make_engine(loaded, tokens, "off"),
            "load": make_engine(loaded, tokens, spec)}
    for e in arms.values():
        await e.start()
    got = {name: {"ttft": [], "cpu": [], "cached": []} for name in arms}
    try:
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                await arms[name].flush_cache()
                ttft, cpu, cached = await timed_request(arms[name], prompt)
                got[name]["ttft"].append(ttft)
                got[name]["cpu"].append(cpu)
                got[name]["cached"].append(cached)
        share = arms["load"].stats().share
    finally:
        for e in arms.values():
            await e.shutdown()
    out = {"store": store, "prompt_tokens": tokens, "rounds": rounds}
    for name, g in got.items():
        out[name] = {"ttft_ms_p50": 1e3 * statistics.median(g["ttft"]),
                     "cpu_ms_p50": 1e3 * statistics.median(g["cpu"]),
                     "requests_with_cached_tokens": sum(1 for c in g["cached"] if c)}
    out["load_over_recompute_ttft"] = out["load"]["ttft_ms_p50"] / out["recompute"]["ttft_ms_p50"]
    out["load_over_recompute_cpu"] = out["load"]["cpu_ms_p50"] / out["recompute"]["cpu_ms_p50"]
    out["loaded_tokens"] = share.loaded_tokens
    out["load_ms_per_token"] = 1e3 * share.load_s_per_token if share.load_s_per_token else None
    costs = arms["load"].peers.costs
    out["engine_costs_ms_per_token"] = {
        "prefill": 1e3 * costs.prefill_s_per_token if costs.prefill_s_per_token else None,
        "peer_load": 1e3 * costs.peer_s_per_token if costs.peer_s_per_token else None}
    return out


async def main_async(args) -> list[dict]:
    loaded = load_model(args.model, dtype="float32")
    rng = random.Random(0)
    prompt = [rng.randrange(100, loaded.config.vocab_size) for _ in range(args.tokens)]
    results = []
    for store in args.stores.split(","):
        if store == "dir":
            with tempfile.TemporaryDirectory() as d:
                results.append(await bench_store(loaded, store, f"dir:{d}", prompt, args.rounds))
        elif store == "ray":
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                results.append(await bench_store(loaded, store, "ray", prompt, args.rounds))
            finally:
                ray.shutdown()
        else:
            raise SystemExit(f"--stores: dir and/or ray, got {store!r}")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", default="dir,ray")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    for r in results:
        print(f"{r['store']}: {r['prompt_tokens']} tokens, {r['rounds']} rounds: TTFT p50 "
              f"recompute {r['recompute']['ttft_ms_p50']:.0f} ms, load "
              f"{r['load']['ttft_ms_p50']:.0f} ms ({r['load_over_recompute_ttft']:.2f}x); CPU "
              f"p50 {r['recompute']['cpu_ms_p50']:.0f} vs {r['load']['cpu_ms_p50']:.0f} ms "
              f"({r['load_over_recompute_cpu']:.2f}x); loaded in "
              f"{r['load']['requests_with_cached_tokens']}/{r['rounds']} requests, "
              f"{r['load_ms_per_token'] or 0:.4f} ms/token fetched")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
