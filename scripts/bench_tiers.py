"""Tiers off vs host (L2) vs disk (L3) vs both, on multi-turn chat whose KV is 4x the pool.

Each conversation has its own system prompt; its turns come back round-robin, so by the
time a conversation returns its prefix has been pushed out of the KV pool. Every mode runs
the same requests one at a time (fp32, greedy), on the default model, and must give the
same replies (checked). Reported per mode: prompt tokens recomputed, TTFT p50/p90,
requests/s, and the measured seconds per token of loading from each tier next to computing
(prefill), from the same run.

    python scripts/bench_tiers.py                       # 12 conversations x 4 turns
    python scripts/bench_tiers.py --conversations 4 --turns 2 --max-tokens 8   # sanity
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.engine.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.sampling_params import SamplingParams  # noqa: E402
from radixserve.model import load_model  # noqa: E402
from radixserve.engine.tier_costs import TierCosts  # noqa: E402

TOPICS = ["rivers", "mountains", "capitals", "castles", "deserts", "islands", "bridges",
          "volcanoes", "lakes", "forests", "canals", "harbours", "glaciers", "caves",
          "waterfalls", "railways"]
QUESTIONS = ["Name one famous example.", "Where is it?", "Why is it known?",
             "Name another one.", "Which is older?", "Say one more fact."]


RULES = ["Answer in one short sentence.", "Be precise and never invent facts.",
         "Prefer metric units.", "Name places by their local names.",
         "Give dates as years.", "Say so when you are unsure."]


def system_prompt(i: int, repeats: int) -> str:
    """A chat API's system prompt: long enough (~45 tokens a repeat) that recomputing it
    costs real prefill time, as production prompts of several hundred tokens do."""
    topic = TOPICS[i % len(TOPICS)]
    rules = " ".join(f"Rule {r + 1} for {topic}: {RULES[r % len(RULES)]}" for r in range(6))
    return f"You are guide number {i}, an expert on {topic}. " + " ".join([rules] * repeats)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def run_mode(loaded, config: EngineConfig, args) -> dict:
    engine = Engine(config, loaded)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    histories = [[{"role": "system", "content": system_prompt(i, args.prompt_repeats)}]
                 for i in range(args.conversations)]
    replies, ttfts, recomputed, cached = [], [], 0, 0
    await engine.start()
    started = time.perf_counter()
    try:
        for turn in range(args.turns):
            for conv in histories:
                conv.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                ids = tok.apply_chat_template(conv)
                tokens, final = [], None
                async for out in engine.generate(ids, params):
                    tokens.extend(out.token_ids)
                    if out.finished:
                        final = out
                ttfts.append(final.first_token_time - final.arrival_time)
                recomputed += final.usage.prompt_tokens - final.usage.cached_tokens
                cached += final.usage.cached_tokens
                replies.append(tokens)
                conv.append({"role": "assistant", "content": tok.decode(tokens)})
        wall = time.perf_counter() - started
        engine.check_invariants()
        stats = engine.stats()
    finally:
        await engine.shutdown()
    costs = engine.tiers.costs.as_dict() if engine.tiers is not None else TierCosts().as_dict()
    return {"replies": replies, "requests": len(replies), "recomputed_tokens": recomputed,
            "cached_tokens": cached, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p90_s": percentile(ttfts, 0.9), "requests_per_s": len(replies) / wall,
            "prefill_s_per_token": costs["prefill_s_per_token"],
            "load_s_per_token": costs["load_s_per_token"],
            "tiers": stats.tiers.as_dict() if stats.tiers is not None else None}


def estimate_kv_tokens(loaded, args) -> int:
    """Tokens of every conversation at its end (the replies at max_tokens each)."""
    tok = loaded.tokenizer
    total = 0
    for i in range(args.conversations):
        conv = [{"role": "system", "content": system_prompt(i, args.prompt_repeats)}]
        for turn in range(args.turns):
            conv.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            conv.append({"role": "assistant", "content": "x " * args.max_tokens})
        total += len(tok.apply_chat_template(conv)) + args.max_tokens
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prompt-repeats", type=int, default=12,
                   help="system prompt length, in repeats of its rules (~45 tokens each)")
    p.add_argument("--modes", default="off,l2,l3,l2+l3")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    loaded = load_model(args.model, dtype="float32")
    total = estimate_kv_tokens(loaded, args)
    pool = max(-(-total // 4), 2 * (total // args.conversations) + 256)
    pool = -(-pool // args.page_size) * args.page_size
    print(f"KV of all conversations ~{total} tokens, pool {pool} tokens "
          f"({total / pool:.1f}x), page size {args.page_size}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
        for mode in args.modes.split(","):
            kw = {}
            if "l2" in mode:
                kw["kv_host_tokens"] = 4 * pool if mode == "l2" else pool
            if "l3" in mode:
                kw["kv_disk_dir"] = str(Path(tmp) / mode)
                kw["kv_disk_bytes"] = 8 * 2**30
            config = EngineConfig(model=args.model, dtype="float32", page_size=args.page_size,
                                  kv_cache_tokens=pool, warmup_tokens=0, **kw)
            results[mode] = asyncio.run(run_mode(loaded, config, args))
            r = results[mode]
            print(f"{mode:6s} recomputed {r['recomputed_tokens']:6d}  TTFT p50 "
                  f"{r['ttft_p50_s'] * 1000:7.1f} ms  p90 {r['ttft_p90_s'] * 1000:7.1f} ms  "
                  f"{r['requests_per_s']:.2f} req/s  prefill "
                  f"{(r['prefill_s_per_token'] or 0) * 1000:.3f} ms/token  load "
                  + ", ".join(f"{t} {v * 1000:.3f} ms/token" for t, v in
                              r["load_s_per_token"].items() if v is not None), flush=True)
    base = results[next(iter(results))]["replies"]
    same = all(r["replies"] == base for r in results.values())
    print("same replies in every mode:", same)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {m: {k: v for k, v in r.items() if k != "replies"} for m, r in results.items()},
            indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
