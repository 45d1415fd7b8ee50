#!/usr/bin/env python
"""The window-aware cache through the real engine on a small Gemma-3-shaped model (the part
of issue 33's bench that needs a model; bench_hybrid.py has the 16k-32k-token replay part).

Model `gemma3-tiny-6l`: a random-weight Gemma 3 text model built here from a transformers
config (nothing downloaded): 6 layers, 5 sliding (window 64) to 1 full, hidden 256, 4
heads, 1 KV head x 64, fp32, the tests' byte-level tokenizer (261 ids).

Measured side by side, alternating the two engines round by round:
- TTFT p50 from turn 2 on: 4 conversations of 6 turns (80-token user messages, 16-token
  greedy answers, prompts growing past 500 tokens), cache on (per-group pools) vs off;
- throughput on a workload with no reuse at all: 16 concurrent distinct 300-token prompts,
  16 tokens each, cache on (per-group pools) vs off, both engines live in a round and
  their batches alternated (`--batches` each); per batch the wall time and the
  process's CPU time (`time.process_time`, every thread: steadier than wall time on a busy
  machine), each as generated tokens per second.

    PYTHONPATH=$PWD python scripts/bench_hybrid_engine.py [--rounds 3] [--batches 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from tiny_models import hf_config, random_hf_model, save_hf_dir  # noqa: E402

from radixserve.engine.config import EngineConfig  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.sampling_params import SamplingParams  # noqa: E402
from radixserve.model.loader import load_model  # noqa: E402

VOCAB = 261
ANSWER = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def build_model(root: Path):
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = hf_config("gemma3_text", hidden_size=256, intermediate_size=512,
                    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=64, sliding_window=64, layer_types=layers,
                    max_position_embeddings=4096)
    return load_model(str(save_hf_dir(root / "gemma3-tiny-6l", random_hf_model(cfg))),
                      dtype="float32")


def engine(loaded, cache: bool) -> Engine:
    return Engine(EngineConfig(kv_cache_tokens=65536, chunked_prefill_size=512,
                               warmup_tokens=0, disable_radix_cache=not cache), loaded)


async def ttft_turns(eng: Engine, rng: np.random.Generator) -> list[float]:
    """TTFT (s) of turns 2.. of 4 conversations taking turns in order."""
    histories = [rng.integers(3, VOCAB, 100).tolist() for _ in range(4)]
    ttfts = []
    for turn in range(6):
        for h in histories:
            h += rng.integers(3, VOCAB, 80).tolist()
            started = time.perf_counter()
            first = None
            async for out in eng.generate(list(h), ANSWER):
                if first is None and out.token_ids:
                    first = time.perf_counter() - started
                h += out.token_ids
            if turn > 0:
                ttfts.append(first)
    return ttfts


async def no_reuse(eng: Engine, rng: np.random.Generator) -> tuple[float, float]:
    """Generated tokens per wall second and per CPU second over 16 concurrent distinct
    prompts."""
    prompts = [rng.integers(3, VOCAB, 300).tolist() for _ in range(16)]

    async def one(p):
        return sum([len(o.token_ids) async for o in eng.generate(p, ANSWER)])
    started, cpu = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return (tokens / (time.perf_counter() - started), tokens / (time.process_time() - cpu))


async def measure(loaded, rounds: int, batches: int) -> None:
    results = {c: {"ttft": [], "tps": [], "cpu_tps": []} for c in (True, False)}
    for r in range(rounds):
        # Both engines live through the round; their no-reuse batches alternate (ABBA...),
        # so a burst of load elsewhere on the machine falls on both sides alike.
        engines = {c: engine(loaded, c) for c in (True, False)}
        for eng in engines.values():
            await eng.start()
        try:
            for cache, eng in engines.items():
                results[cache]["ttft"] += await ttft_turns(eng, np.random.default_rng(r))
            for b in range(batches):
                for cache in ((True, False) if (r + b) % 2 else (False, True)):
                    seed = 100 + r * batches + b        # both sides get the same prompts
                    tps, cpu_tps = await no_reuse(engines[cache], np.random.default_rng(seed))
                    results[cache]["tps"].append(tps)
                    results[cache]["cpu_tps"].append(cpu_tps)
        finally:
            for eng in engines.values():
                await eng.shutdown()
    on, off = results[True], results[False]
    p50_on, p50_off = statistics.median(on["ttft"]), statistics.median(off["ttft"])
    tps_on, tps_off = statistics.median(on["tps"]), statistics.median(off["tps"])
    print(f"TTFT p50 from turn 2 on: cache on {p50_on * 1e3:.1f} ms, off {p50_off * 1e3:.1f} ms"
          f" ({p50_on / p50_off:.2f}x)")
    print(f"no reuse (wall): cache on {tps_on:.1f} tok/s, off {tps_off:.1f} tok/s "
          f"({(tps_on / tps_off - 1) * 100:+.1f}%; target >= -2%)")
    cpu_on, cpu_off = statistics.median(on["cpu_tps"]), statistics.median(off["cpu_tps"])
    print(f"no reuse (CPU time): cache on {cpu_on:.1f} tok/CPU-s, off {cpu_off:.1f} tok/CPU-s "
          f"({(cpu_on / cpu_off - 1) * 100:+.1f}%)")
    pairs = [(a / b, c / d) for a, b, c, d in zip(on["tps"], off["tps"], on["cpu_tps"],
                                                     off["cpu_tps"])]
    print(f"  per batch pair, on/off: median wall {statistics.median(p[0] for p in pairs):.3f}"
          f", median CPU {statistics.median(p[1] for p in pairs):.3f} over {len(pairs)} pairs")
    for i, (wall, cpu) in enumerate(pairs):
        print(f"  batch {i}: wall on/off {wall:.3f}, CPU on/off {cpu:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=1,
                    help="no-reuse batches per engine and round, alternated between them")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        loaded = build_model(Path(root))
        asyncio.run(measure(loaded, args.rounds, args.batches))


if __name__ == "__main__":
    main()
