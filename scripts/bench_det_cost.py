"""What deterministic mode costs on bench_engine.py's workload, and where: the default and the
deterministic mode (cache on) run alternately in one process, N rounds, and each run's CPU
time of the engine's steps is split into prefill steps / decode steps and, within them,
attention (the backend's forward).

One torch thread and CPU time (time.thread_time on the compute thread), so the ratios hold
on a machine that other jobs load; wall time is printed too. --threads N (N > 1): N torch
threads and wall time per category instead (the other threads' CPU time is not the
compute thread's), for bench_engine's 2-thread setting. Smaller than bench_engine's
default workload (--groups 4: 32 requests) to keep a round short.

  PYTHONPATH=. python scripts/bench_det_cost.py --rounds 2 [--threads 2] [--splits 128,256]

--splits: the deterministic mode once per split size (fixed_split's keys per chunk), the
first being the default.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time

import torch

import bench_engine
from radixserve.attention.fixed_split import DEFAULT_SPLIT, FixedSplitBackend
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.engine import runner as runner_module
from radixserve.engine.compute_thread import on_compute_thread
from radixserve.model import load_model


class StepClock:
    """CPU seconds of the runner's steps by kind, and of attention within them."""

    def __init__(self, clock=time.thread_time) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.kind = "decode"
        self.clock = clock

    def install(self) -> None:
        execute = runner_module.ModelRunner.execute

        def timed_execute(runner, batch):
            self.kind = ("prefill" if any(s.new_len > 1 for s in batch.spans)
                         else "decode")
            t0 = self.clock()
            try:
                return execute(runner, batch)
            finally:
                self.seconds[self.kind] += self.clock() - t0

        runner_module.ModelRunner.execute = timed_execute
        for cls in (TorchAttentionBackend, FixedSplitBackend):
            cls.forward = self._timed_attention(cls.forward)

    def _timed_attention(self, forward):
        def timed(backend, *args):
            t0 = self.clock()
            try:
                return forward(backend, *args)
            finally:
                self.seconds[self.kind + " attention"] += self.clock() - t0
        return timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--splits", default=str(DEFAULT_SPLIT))
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    args = argparse.Namespace(model=a.model, dtype="bfloat16", groups=a.groups, per_group=8,
                              system=1024, question=64, output=32, chunked_prefill_size=2048,
                              kv_cache_tokens=131072, seed=0)
    clock = StepClock(time.thread_time if a.threads == 1 else time.perf_counter)
    clock.install()
    loaded = on_compute_thread(load_model, args.model, dtype=args.dtype)
    prompts = bench_engine.make_prompts(args)
    modes = ["default"] + [f"deterministic, split {s}" for s in a.splits.split(",")]
    runs: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    outputs: dict[str, list] = {}
    unit = "CPU s" if a.threads == 1 else "wall s"
    print(f"{len(prompts)} requests, {a.threads} thread(s), {a.rounds} alternated rounds; {unit}")
    for _ in range(a.rounds):
        for mode in modes:
            det = mode != "default"
            if det:
                FixedSplitBackend.__init__.__kwdefaults__["split"] = int(mode.split()[-1])
            clock.seconds.clear()
            r = asyncio.run(bench_engine.run_engine(loaded, prompts, args,
                                                    disable_cache=False, deterministic=det))
            got = dict(clock.seconds, wall=r["wall"])
            got["total"] = got["prefill"] + got["decode"]
            runs[mode].append(got)
            if det and mode in outputs:     # deterministic: the same tokens every round
                assert outputs[mode] == r["outputs"], f"{mode}: outputs changed between runs"
            outputs[mode] = r["outputs"]
            print(f"  {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(got.items())),
                  flush=True)
    FixedSplitBackend.__init__.__kwdefaults__["split"] = DEFAULT_SPLIT
    keys = ["total", "prefill", "prefill attention", "decode", "decode attention"]
    print(f"\n{'medians, ' + unit:<28}" + "".join(f"{k:>19}" for k in keys) + f"{'vs default':>12}")
    base = statistics.median(r["total"] for r in runs["default"])
    for mode in modes:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in keys}
        print(f"{mode:<28}" + "".join(f"{med[k]:>19.2f}" for k in keys)
              + f"{med['total'] / base:>11.2f}x")
    pairs = [d["total"] / b["total"] for d, b in zip(runs[modes[1]], runs["default"])]
    print(f"{modes[1]} vs default, each round: " + ", ".join(f"{p:.2f}x" for p in pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
