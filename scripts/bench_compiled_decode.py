#!/usr/bin/env python
"""The lone decode step eager against compiled (``--decode-compile``), in one process.

``ModelRunner.execute`` of one sequence's decode step (page table, forward, greedy sample)
at each ``--contexts`` length, pages in the allocator's order (a prompt's in descending
ids), the same K/V contents for both sides; rounds alternate which side goes first, and
each step's wall and process CPU time are kept (CPU time is the steadier figure on a
shared machine). The compiled step comes from the weights cache dir, or is compiled first
by the runner's child process, exactly as a server does: the script prints how long that
took (cold compile) or how long loading took (warm).

    python scripts/bench_compiled_decode.py --threads 1 --contexts 128,512 --rounds 6
    # ~1 min warm; add the cold compile (~2-5 min, busy machine) on the first run

``--check-tokens N`` also decodes N tokens greedily from a short prompt each way and
prints how many of them agree (logits differ by rounding: fused kernels sum in another
order, and the int4 kernels round their bf16 inputs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from radixserve.attention.spans import SeqSpan
from radixserve.engine.batch import StepBatch
from radixserve.engine.config import EngineConfig
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model import load_model
from radixserve.model.weights_cache import WeightsCache


def lone_batch(token: int, context: int, pages: np.ndarray) -> StepBatch:
    return StepBatch(input_ids=[token], positions=[context - 1],
                     spans=[SeqSpan(pages, context - 1, 1)], sample_rows=[0],
                     sample_params=[SamplingParams(max_tokens=1, temperature=0.0)],
                     generators=[None])


def allocator_pages(context: int, prompt: int) -> np.ndarray:
    """A served stream's pages (page size 1): the prompt's in descending ids, then one up
    per decoded token (torch_plans.lone_decode_runs)."""
    first = np.arange(prompt, dtype=np.int32)[::-1]
    return np.concatenate([first, np.arange(prompt, context, dtype=np.int32)])


def wait_compiled(runner: ModelRunner) -> None:
    compiled = runner.compiled_decode
    t0 = time.perf_counter()
    if compiled.compiling_pid is not None:
        print(f"compiling (pid {compiled.compiling_pid}, log {compiled.paths.log}) ...",
              flush=True)
        compiled.wait_for_compile()
        print(f"cold compile: {time.perf_counter() - t0:.1f} s", flush=True)
    if not compiled.ready:
        raise SystemExit(f"no compiled step: {compiled.stats.reason}")
    print(f"compiled step ready {compiled.stats.ready_after_s:.2f} s after the runner's "
          f"start ({'loaded from the cache' if compiled.stats.compiles_started == 0 else 'after compiling'})")


def greedy(runner: ModelRunner, prompt: list[int], n: int, compiled: bool) -> list[int]:
    saved = runner.compiled_decode
    runner.compiled_decode = saved if compiled else None
    try:
        pages = np.arange(len(prompt) + n, dtype=np.int32)
        batch = StepBatch(input_ids=prompt, positions=list(range(len(prompt))),
                          spans=[SeqSpan(pages, 0, len(prompt))], sample_rows=[0],
                          sample_params=[SamplingParams(max_tokens=1, temperature=0.0)],
                          generators=[None])
        out = [runner.execute(batch).sample.token_ids[0]]
        for i in range(n - 1):
            out.append(runner.execute(lone_batch(out[-1], len(prompt) + i + 1,
                                                 pages)).sample.token_ids[0])
        return out
    finally:
        runner.compiled_decode = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights-dtype", default="int4")
    p.add_argument("--weights-cache-dir", default=None)
    p.add_argument("--contexts", default="128,512")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10, help="steps per side per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check-tokens", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cache = WeightsCache.at(args.weights_cache_dir)
    loaded = load_model(args.model, dtype=args.dtype, weights_cache=cache,
                        weights_dtype=args.weights_dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    config = EngineConfig(model=args.model, kv_cache_tokens=max(contexts) + 256,
                          decode_compile="on", weights_cache_dir=args.weights_cache_dir,
                          weights_dtype=args.weights_dtype)
    runner = ModelRunner(config, loaded)
    wait_compiled(runner)
    for t in runner.kv_pool.k_flat + runner.kv_pool.v_flat:
        t.normal_(generator=torch.Generator().manual_seed(0))
    compiled = runner.compiled_decode
    sides = {"eager": None, "compiled": compiled}
    wall = {(s, n): [] for s in sides for n in contexts}
    cpu = {(s, n): [] for s in sides for n in contexts}
    for r in range(args.rounds + 1):                     # round 0: warm-up, not kept
        order = list(sides) if r % 2 else list(sides)[::-1]
        for n in contexts:
            batch = lone_batch(17, n, allocator_pages(n, n - 8))
            for side in order:
                runner.compiled_decode = sides[side]
                for _ in range(args.steps):
                    w0, c0 = time.perf_counter(), time.process_time()
                    runner.execute(batch)
                    if r:
                        wall[side, n].append(time.perf_counter() - w0)
                        cpu[side, n].append(time.process_time() - c0)
    runner.compiled_decode = compiled
    print(f"\ntorch {torch.__version__}, {args.threads} thread(s), {loaded.weights_dtype} "
          f"weights, {loaded.dtype} activations; medians of {args.rounds} rounds x "
          f"{args.steps} steps")
    print("| context | eager wall ms | compiled wall ms | eager CPU ms | compiled CPU ms "
          "| CPU eager / compiled |")
    print("|---|---|---|---|---|---|")
    for n in contexts:
        we, wc = statistics.median(wall["eager", n]), statistics.median(wall["compiled", n])
        ce, cc = statistics.median(cpu["eager", n]), statistics.median(cpu["compiled", n])
        print(f"| {n} | {we * 1e3:.2f} | {wc * 1e3:.2f} | {ce * 1e3:.2f} | {cc * 1e3:.2f} "
              f"| {ce / cc:.2f}x |")
    if args.check_tokens:
        prompt = loaded.tokenizer.encode("The radix tree stores strings that share")
        a = greedy(runner, prompt, args.check_tokens, compiled=False)
        b = greedy(runner, prompt, args.check_tokens, compiled=True)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"greedy tokens: the first {same} of {len(a)} agree")


if __name__ == "__main__":
    main()
