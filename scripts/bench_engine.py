"""Shared-system-prompt workload through the engine: radix cache on vs off vs transformers.

8 groups x 8 prompts (1024-token system prompt per group + 64-token question), 32 output
tokens each (ignore_eos), shuffled, all submitted at once. The runs happen in one process on
the same weights and dtype, so the ratios printed at the end are side by side: cache on,
cache off, cache on again (the ratios use the mean of both cache-on runs, which cancels the
VM's drift over the long cache-off run), then transformers.

    python scripts/bench_engine.py [--groups 8 --per-group 8 --system 1024 --question 64
                                    --output 32 --dtype bfloat16] [--skip-hf] [--single-on]
                                   [--quick] [--deterministic]

--compare-weights bf16,auto: instead, the cache-on run once per weights form, in the order
A B B A (the drift cancels in the means), and the ratio of their wall times (issue 41:
quantized weights must not slow this workload).

--deterministic: the engine runs in deterministic mode (docs/deterministic.md), and a
default-mode cache-on run before and after the deterministic ones gives the mode's cost,
side by side; it also reports how many outputs are identical cache on vs off.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from radixserve.engine.compute_thread import on_compute_thread
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model import load_model
from radixserve.model.hf_reference import hf_model_for
from radixserve.perf.probe import measure_peaks
from radixserve.perf.roofline import ModelShape, cache_on_and_off


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = range(200, 48000)           # clear of special tokens
    prompts = []
    for _ in range(args.groups):
        system = [rng.choice(vocab) for _ in range(args.system)]
        for _ in range(args.per_group):
            prompts.append(system + [rng.choice(vocab) for _ in range(args.question)])
    rng.shuffle(prompts)
    return prompts


async def run_engine(loaded, prompts, args, disable_cache: bool,
                     deterministic: bool = False) -> dict:
    config = EngineConfig(model=args.model, dtype=args.dtype, disable_radix_cache=disable_cache,
                          deterministic=deterministic,
                          chunked_prefill_size=args.chunked_prefill_size,
                          kv_cache_tokens=args.kv_cache_tokens,
                          warmup_tokens=args.chunked_prefill_size)   # a full-size step first
    engine = Engine(config, loaded)
    await engine.start()
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    ttft, outputs, cached = [], [], 0

    async def one(prompt):
        nonlocal cached
        tokens = []
        async for out in engine.generate(prompt, params):
            tokens += out.token_ids
            if out.finished:
                ttft.append(out.first_token_time - out.arrival_time)
                cached += out.usage.cached_tokens
        outputs.append(tokens)
        return tokens

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    steps = engine.stats().steps
    sched_ms = engine.core.bookkeeping_seconds / max(steps, 1) * 1e3
    engine.check_invariants()
    await engine.shutdown()
    return {"wall": wall, "ttft": ttft, "outputs": results, "cached": cached,
            "steps": steps, "sched_ms": sched_ms}


def run_hf(loaded, prompts, args) -> dict:
    model = hf_model_for(args.model, loaded)
    outputs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            batch = torch.tensor(prompts[i:i + args.hf_batch])
            out = model.generate(batch, attention_mask=torch.ones_like(batch),
                                 max_new_tokens=args.output, min_new_tokens=args.output,
                                 do_sample=False, pad_token_id=0)
            outputs += out[:, batch.shape[1]:].tolist()
    return {"wall": time.perf_counter() - t0, "outputs": outputs}


def workload_floors(loaded, args) -> dict[str, float]:
    """This machine's floor for the workload, cache on and off (radixserve/perf/roofline.py):
    prefill FLOPs at the measured GEMM rate + decode steps at max(FLOPs, bytes / bandwidth)."""
    shape = ModelShape.of(loaded.config)
    peaks, _ = measure_peaks(shape, loaded.dtype, decode_batch=args.groups * args.per_group,
                             prefill_batch=args.chunked_prefill_size)
    floors = cache_on_and_off(shape, peaks, args.groups, args.per_group, args.system,
                              args.question, args.output, dtype_bytes=loaded.dtype.itemsize)
    for cache, f in floors.items():
        print(f"floor, cache {cache}: prefill {f.prefill_s:.2f} s + decode {f.decode_s:.2f} s = "
              f"{f.total_s:.2f} s (GEMM {peaks.prefill_gflops:.0f} / {peaks.decode_gflops:.0f} "
              f"GFLOP/s at {args.chunked_prefill_size} / {args.groups * args.per_group} rows, "
              f"{peaks.bandwidth_gbs:.1f} GB/s)")
    return {cache: f.total_s for cache, f in floors.items()}


_FLOOR_OF_RUN = {"cache on": "on", "cache on again": "on", "cache off": "off"}


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def compare_weights(args, forms: list[str]) -> None:
    """Cache on, once per weights form in the order A B B A; the mean walls' ratio."""
    loaded = {w: on_compute_thread(load_model, args.model, dtype=args.dtype, weights_dtype=w)
              for w in forms}
    prompts = make_prompts(args)
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{len(prompts) * args.output} output tokens, dtype {args.dtype}, torch threads "
          f"{torch.get_num_threads()}; weights {' vs '.join(forms)}")
    walls: dict[str, list[float]] = {w: [] for w in forms}
    outputs: dict[str, list] = {}
    for w in forms + forms[::-1]:
        r = asyncio.run(run_engine(loaded[w], prompts, args, disable_cache=False))
        walls[w].append(r["wall"])
        outputs.setdefault(w, r["outputs"])
        print(f"{w:<8} wall {r['wall']:6.2f} s, {len(prompts) * args.output / r['wall']:6.1f} "
              f"out tok/s, TTFT p50 {statistics.median(r['ttft']):.2f} s", flush=True)
    a, b = forms
    ratio = statistics.mean(walls[a]) / statistics.mean(walls[b])
    same = sum(x == y for x, y in zip(outputs[a], outputs[b]))
    print(f"\n{b} vs {a}: {ratio:.2f}x the speed (mean wall {statistics.mean(walls[a]):.2f} s "
          f"vs {statistics.mean(walls[b]):.2f} s); greedy outputs identical {same}/{len(prompts)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=131072)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--single-on", action="store_true",
                   help="one cache-on run only (default: on, off, on again; ratios use both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2x2 prompts of 64+8 tokens")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic mode, with default-mode cache-on runs for its cost")
    p.add_argument("--compare-weights", default=None, metavar="A,B",
                   help="cache on with two --weights-dtype forms side by side (A B B A)")
    p.add_argument("--skip-floor", action="store_true",
                   help="do not measure this machine's roofline (scripts/roofline.py)")
    args = p.parse_args()
    if args.quick:
        args.groups, args.per_group, args.system, args.question, args.output = 2, 2, 64, 8, 4

    torch.manual_seed(0)
    if args.compare_weights:
        compare_weights(args, args.compare_weights.split(","))
        return
    # Load on the engine's compute thread: see radixserve/engine/compute_thread.py.
    loaded = on_compute_thread(load_model, args.model, dtype=args.dtype)
    prompts = make_prompts(args)
    n_prompt = sum(map(len, prompts))
    print(f"{len(prompts)} requests, {n_prompt} prompt tokens, {len(prompts) * args.output} "
          f"output tokens, dtype {args.dtype}, torch threads {torch.get_num_threads()}")

    # Cache on, off, on again: this VM's speed drifts within minutes, and the cache-off run is
    # ~5x longer; comparing it with the mean of the runs before and after it cancels a steady
    # drift instead of crediting (or blaming) the cache for it.
    runs = {}
    if args.deterministic:
        runs["default on"] = asyncio.run(run_engine(loaded, prompts, args, disable_cache=False,
                                                    deterministic=False))
    det = args.deterministic
    runs["cache on"] = asyncio.run(run_engine(loaded, prompts, args, disable_cache=False,
                                              deterministic=det))
    runs["cache off"] = asyncio.run(run_engine(loaded, prompts, args, disable_cache=True,
                                               deterministic=det))
    if not args.single_on:
        runs["cache on again"] = asyncio.run(run_engine(loaded, prompts, args,
                                                        disable_cache=False,
                                                        deterministic=det))
    if args.deterministic:
        runs["default again"] = asyncio.run(run_engine(loaded, prompts, args,
                                                       disable_cache=False,
                                                       deterministic=False))
    if not args.skip_hf:
        runs["transformers"] = on_compute_thread(run_hf, loaded, prompts, args)

    floors = {} if args.skip_floor else on_compute_thread(workload_floors, loaded, args)
    total_out = len(prompts) * args.output
    print(f"\n{'run':<14}{'wall s':>9}{'out tok/s':>11}{'TTFT p50 s':>12}{'TTFT p90 s':>12}"
          f"{'cached':>9}{'sched ms/step':>15}{'floor s':>9}{'floor/wall':>11}")
    for name, r in runs.items():
        ttft = r.get("ttft")
        floor = floors.get(_FLOOR_OF_RUN.get(name, ""), float("nan"))
        print(f"{name:<14}{r['wall']:>9.2f}{total_out / r['wall']:>11.1f}"
              f"{(statistics.median(ttft) if ttft else float('nan')):>12.2f}"
              f"{(pct(ttft, 0.9) if ttft else float('nan')):>12.2f}"
              f"{r.get('cached', 0) / n_prompt:>9.1%}"
              f"{r.get('sched_ms', float('nan')):>15.2f}"
              + (f"{floor:>9.2f}{floor / r['wall']:>11.1%}" if floor == floor  # not nan
                 else f"{'-':>9}{'-':>11}"))
    on, off = runs["cache on"], runs["cache off"]
    ons = [r for name, r in runs.items() if name.startswith("cache on")]
    on_wall = statistics.mean(r["wall"] for r in ons)
    on_ttft = statistics.mean(statistics.median(r["ttft"]) for r in ons)
    each = " / ".join(f"{off['wall'] / r['wall']:.2f}x" for r in ons)
    print(f"\ncache on vs off: {off['wall'] / on_wall:.2f}x end to end"
          f"{f' (against each cache-on run: {each})' if len(ons) > 1 else ''}, TTFT p50 "
          f"{statistics.median(off['ttft']) / on_ttft:.2f}x")
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"]))
    mode = "deterministic mode, " if args.deterministic else ""
    print(f"greedy outputs identical cache on vs off ({mode}same process): "
          f"{same}/{len(prompts)}")
    if args.deterministic:
        defaults = [runs["default on"], runs["default again"]]
        default_wall = statistics.mean(r["wall"] for r in defaults)
        print(f"deterministic vs default mode, cache on: {on_wall / default_wall:.2f}x the "
              f"wall time (default runs {defaults[0]['wall']:.2f} s / "
              f"{defaults[1]['wall']:.2f} s)")
        same = sum(a == b for a, b in zip(*(r["outputs"] for r in defaults)))
        print(f"default mode, two cache-on runs identical: {same}/{len(prompts)}")
    if "transformers" in runs:
        hf = runs["transformers"]
        print(f"cache on vs transformers generate (batches of {args.hf_batch}): "
              f"{hf['wall'] / on_wall:.2f}x end to end")
        same = sum(a == b for a, b in zip(on["outputs"], hf["outputs"]))
        print(f"greedy outputs identical to transformers: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
