"""The KV events' cost on the engine's step at 256 running, counted in instructions (issue
37's bound: events on vs off at most 2% apart), under valgrind's callgrind.

    PYTHONPATH=. python scripts/bench_kv_events_instructions.py     # ~5 min, any load

Why instructions: the time of a 4-5 ms scheduling step varies by 10-25% from round to
round on the 2-vCPU machines here (interquartile range of the on/off ratio over 100-step
rounds, scripts/bench_kv_events_step.py), so a 2% bound needs thousands of pairs. The
instructions the engine's process executes for the same steps are the same from run to
run, whatever else the machine does. They count only the engine's side: the publisher
process (child.py) runs outside valgrind, on the other core; bench_kv_events_step.py
shows what it costs the engine in time (with `--control-busy`: a busy loop there).

Each arm is one engine core of bench_kv_events_step.py (stand-in forward, the shared-prefix
churn), run in a process of its own under callgrind for a short and a long run of steps
after the same warm-up; the difference of the two totals over the difference of steps is
the instructions per step, with start-up and warm-up cancelled. Hash seed fixed and
address randomisation off (`setarch -R`), so a repeat gives the same count (printed).
Under valgrind a step takes ~50x as long, so the events' hand-over interval
(--kv-events-interval-ms, KVEvents.after_step) runs on a clock that advances by the step's
median time measured first without valgrind (`--step-ms` to set it).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHORT, LONG = 50, 250       # timed steps of the two runs
WARMUP = 60                 # steps to the steady churn, before either


class StepClock:
    """A clock that advances by one step's time per step (the hand-over interval's)."""

    def __init__(self, step_s: float):
        self.step_s, self.now = step_s, 0.0

    def __call__(self) -> float:
        return self.now


def run_arm(events: bool, page_size: int, steps: int, step_s: float) -> None:
    """(Under valgrind.) Warm up, then `steps` steps of one arm."""
    from bench_kv_events_step import Arm

    clock = StepClock(step_s)
    arm = Arm(None, events, page_size, clock=clock)
    for _ in range(WARMUP):
        clock.now += step_s
        arm.step()
    gc.collect()
    gc.freeze()
    for _ in range(steps):
        clock.now += step_s
        arm.step()
    if arm.kv is not None:
        arm.kv.publisher.wait_idle(timeout_s=60)
    arm.close()


def native_step_s(page_size: int) -> float:
    """The median wall time of an events-off step, without valgrind."""
    from bench_kv_events_step import Arm

    arm = Arm(None, False, page_size)
    arm.round(1, WARMUP)
    walls = []
    for _ in range(100):
        t0 = time.perf_counter()
        arm.step()
        walls.append(time.perf_counter() - t0)
    arm.close()
    return statistics.median(walls)


def count(events: bool, page_size: int, steps: int, step_s: float) -> int:
    """Instructions of one process running `steps` steps of an arm (callgrind's total)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
               sys.executable, __file__, "--arm", "on" if events else "off",
               "--page-size", str(page_size), "--steps", str(steps),
               "--step-ms", str(step_s * 1e3)]
    if shutil.which("setarch"):
        command = ["setarch", "-R"] + command
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"callgrind run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1))


def per_step(pool: ThreadPoolExecutor, events: bool, page_size: int,
             step_s: float) -> Callable[[], float]:
    """Starts the two runs in `pool`; returns a call that waits for them and gives the
    instructions per step."""
    long, short = (pool.submit(count, events, page_size, n, step_s) for n in (LONG, SHORT))
    return lambda: (long.result() - short.result()) / (LONG - SHORT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measurements per arm (they should agree)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="valgrind runs at once (counts do not depend on the load)")
    parser.add_argument("--arm", choices=["off", "on"], help=argparse.SUPPRESS)
    parser.add_argument("--page-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step-ms", type=float, default=None,
                        help="the step time the hand-over interval sees (default: measured)")
    args = parser.parse_args()
    if args.arm:
        run_arm(args.arm == "on", args.page_size, args.steps, args.step_ms / 1e3)
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is needed (Debian: apt-get install valgrind)")
    started = time.monotonic()
    print(f"256 running, shared-prefix churn, stand-in forward; engine process instructions "
          f"per step ({LONG} - {SHORT} steps under callgrind), {args.repeats} repeats")
    print(f"{'page':>5} {'step ms':>8} {'off':>14} {'on':>14} {'on/off':>8}")
    for page_size in map(int, args.page_sizes.split(",")):
        step_s = args.step_ms / 1e3 if args.step_ms else native_step_s(page_size)
        with ThreadPoolExecutor(args.jobs) as runs:
            off = [per_step(runs, False, page_size, step_s) for _ in range(args.repeats)]
            on = [per_step(runs, True, page_size, step_s) for _ in range(args.repeats)]
            off, on = [wait() for wait in off], [wait() for wait in on]
        for a, b in zip(off, on):
            print(f"{page_size:>5} {step_s * 1e3:>8.2f} {a:>14,.0f} {b:>14,.0f} {b / a:>8.4f}",
                  flush=True)
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
