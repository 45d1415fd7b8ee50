"""The scheduler's own CPU time per step, with a stand-in model whose forward costs nothing.

Measures Scheduler.schedule() + Scheduler.complete() (admission, page reservation, batch
assembly, sampling bookkeeping) plus the output processor (stop checks, streaming) and,
separately, the page-table metadata the runner builds, at 1, 64 and 256 running decodes.

    python scripts/bench_scheduler.py [--steps 200] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from radixserve.attention.metadata import build_metadata
from radixserve.engine.core import EngineCore
from radixserve.engine.null_model import NullRunner, null_core
from radixserve.engine.request import new_request
from radixserve.engine.sampling_params import SamplingParams


def build(running: int, page_size: int, prompt_len: int, shared: int) -> tuple[EngineCore, list]:
    pages = (running * (prompt_len + 4096)) // page_size + 1024
    core = null_core(num_pages=pages, page_size=page_size, max_running=running,
                     token_budget=8192)
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(shared)]
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True,
                            stop=["STOP"])   # never produced: the stand-in emits a-z
    sink = []
    for r in range(running):
        prompt = prefix + [rng.randrange(1000) for _ in range(prompt_len - shared)]
        core.add(new_request(f"r{r}", prompt, params, None, sink.append, page_size))
    return core, sink


def measure(running: int, steps: int, page_size: int) -> dict:
    core, sink = build(running, page_size, prompt_len=256, shared=128)
    runner = NullRunner(page_size=page_size)
    sched = core.scheduler
    while any(s.in_prefill for s in sched.running) or sched.waiting:   # reach steady decode
        plan = core.schedule()
        core.complete(plan, runner.execute(plan.batch))
    sched_times, meta_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = core.schedule()
        t1 = time.perf_counter()
        result = runner.execute(plan.batch)
        t2 = time.perf_counter()
        core.complete(plan, result)
        t3 = time.perf_counter()
        build_metadata(plan.batch.spans, page_size, "cpu")
        t4 = time.perf_counter()
        sched_times.append((t1 - t0) + (t3 - t2))
        meta_times.append(t4 - t3)
        sink.clear()
    assert len(plan.batch.spans) == running
    return {"running": running, "page_size": page_size,
            "scheduler_ms": statistics.median(sched_times) * 1e3,
            "metadata_ms": statistics.median(meta_times) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    print(f"{'running':>8} {'page':>5} {'scheduler ms/step':>18} {'metadata ms/step':>17} {'target':>8}")
    for page_size in (1, 16):
        for running in (1, 64, 256):
            r = measure(running, steps, page_size)
            target = "<= 1 ms" if running == 256 else ""
            print(f"{r['running']:>8} {page_size:>5} {r['scheduler_ms']:>18.3f} "
                  f"{r['metadata_ms']:>17.3f} {target:>8}")


if __name__ == "__main__":
    main()
