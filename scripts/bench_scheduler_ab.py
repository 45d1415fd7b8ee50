"""The scheduler's step at 256 running decodes, this tree's engine/scheduler.py against a git
revision's, in alternated rounds (the order flips each round), CPU time per step beside wall.

    PYTHONPATH=. python scripts/bench_scheduler_ab.py --base f023156 [--rounds 6] [--steps 200]

Runs bench_scheduler.py's steady-decode workload (256 running, page 1 and 16) with the
revision's Scheduler swapped into the null core; everything else is this tree's, so the
revision's scheduler.py must still import against it. thread_time is much steadier than wall
time on a shared machine; the ratio is new / base (medians over rounds of per-step medians).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_scheduler  # noqa: E402

from radixserve.engine import null_model, scheduler  # noqa: E402


def load_revision(rev: str):
    """engine/scheduler.py as it was at `rev`, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:radixserve/engine/scheduler.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "base_scheduler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_scheduler"] = module
    spec.loader.exec_module(module)
    return module


def one_round(module, page_size: int, steps: int) -> tuple[float, float]:
    """(median CPU ms, median wall ms) per steady-decode step with `module`'s Scheduler."""
    null_model.Scheduler, null_model.SchedulerConfig = module.Scheduler, module.SchedulerConfig
    core, sink = bench_scheduler.build(256, page_size, prompt_len=256, shared=128)
    runner = null_model.NullRunner(page_size=page_size)
    sched = core.scheduler
    while any(s.in_prefill for s in sched.running) or sched.waiting:
        plan = core.schedule()
        core.complete(plan, runner.execute(plan.batch))
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.thread_time(), time.perf_counter()
        plan = core.schedule()
        core.complete(plan, runner.execute(plan.batch))
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        sink.clear()
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    base = load_revision(args.base)
    print(f"{'page':>5} {'base cpu ms':>12} {'new cpu ms':>11} {'new/base':>9} "
          f"{'base wall ms':>13} {'new wall ms':>12} {'new/base':>9}")
    for page_size in (1, 16):
        runs: dict[str, list[tuple[float, float]]] = {"base": [], "new": []}
        for r in range(args.rounds):
            order = [("base", base), ("new", scheduler)]
            for name, module in (order if r % 2 == 0 else order[::-1]):
                runs[name].append(one_round(module, page_size, args.steps))
        b, n = ([statistics.median(x[i] for x in runs[k]) for i in (0, 1)]
                for k in ("base", "new"))
        print(f"{page_size:>5} {b[0]:>12.3f} {n[0]:>11.3f} {n[0] / b[0]:>9.3f} "
              f"{b[1]:>13.3f} {n[1]:>12.3f} {n[1] / b[1]:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
