"""Does a start-up warm-up pay for itself? For each warm-up size W, a fresh process loads the
default model, builds a ModelRunner, warms up W tokens, then times a short first request
(a 40-token prefill and 31 decodes) and a 2,048-token prefill after it.

    python scripts/bench_warmup.py --warmups 0 32 2048 --rounds 2 --threads 1 --clock cpu

Sizes run interleaved, one process each. `--clock cpu` (process CPU time, with one torch
thread) is the figure to use on a shared machine; `--clock wall` on an idle one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))          # this checkout's radixserve, not another install


def one(warmup: int, threads: int, clock_name: str) -> str:
    import numpy as np
    import torch

    from radixserve.attention.metadata import SeqSpan
    from radixserve.engine.batch import StepBatch
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.runner import ModelRunner
    from radixserve.engine.sampling_params import SamplingParams
    from radixserve.model import load_model
    from radixserve.model.weights_cache import WeightsCache

    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    loaded = load_model("smollm2-135m-instruct", weights_cache=WeightsCache.at())
    runner = ModelRunner(EngineConfig(kv_cache_tokens=65536), loaded)

    def step(pages, start: int, ids: list[int]):
        return runner.execute(StepBatch(
            input_ids=ids, positions=list(range(start, start + len(ids))),
            spans=[SeqSpan(pages, start, len(ids))], sample_rows=[0],
            sample_params=[SamplingParams(max_tokens=1, temperature=0.0)], generators=[None]))

    t0 = clock()
    if warmup:
        runner.warm_up(np.arange(60000, 60000 + warmup), warmup)
    warm = clock() - t0
    t0 = clock()
    pages = np.arange(0, 100)
    out = step(pages, 0, list(range(100, 140)))
    for i in range(31):
        out = step(pages, 40 + i, [out.sample.token_ids[0]])
    short = clock() - t0
    t0 = clock()
    step(np.arange(1000, 3048), 0, list(range(5, 2053)))
    long_ = clock() - t0
    return (f"warm-up {warmup:5d}: {warm:.2f} s, first short request {short:.2f} s, "
            f"then a 2048-token prefill {long_:.2f} s; warm-up + first request "
            f"{warm + short:.2f} s ({clock_name})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmups", type=int, nargs="+", default=[0, 32, 2048])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="wall")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(one(args.one, args.threads, args.clock), flush=True)
        return
    for _ in range(args.rounds):
        for w in args.warmups:
            subprocess.run([sys.executable, __file__, "--one", str(w), "--threads",
                            str(args.threads), "--clock", args.clock], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
