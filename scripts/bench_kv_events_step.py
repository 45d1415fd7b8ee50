"""The KV events' cost on the WHOLE engine step at 256 running, events on vs off (issue
37's bound: at most 2% apart), with the stand-in model (the worst case: a step of pure
scheduling) and with a real forward pass (a tiny random-weight Llama from a
`transformers` config, through the engine's ModelRunner and paged attention).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench_kv_events_step.py   # ~6 min idle

Four arms are built once and kept: {stand-in, model} x {events off, on}, each a 256-slot
engine core on a shared-prefix churn (requests of 256 tokens behind a 128-token prefix,
8-48 new tokens each, a pool that evicts; new requests are added as old ones finish), so
every step inserts, evicts and announces pages. Per model, `--pairs` pairs of rounds
(ABBA order: drift hits both), each round `--steps` timed steps after `--warmup`; a step
is schedule + forward + complete + the events' flush, as the engine's loop runs them, on
this thread. Per pair: the on/off ratio of the engine thread's CPU per step
(`time.thread_time`, steadier than wall on a busy machine) and of the median step's wall
time; printed as medians with bootstrap 95% intervals. Beside them, per step and per arm,
the counters of step_counters.py (GC collections and their CPU, allocated blocks,
context switches) and the publisher process's wake-ups.

Why the counters: a full (gen2) collection over the start-up heap (torch's imports and
the tree, ~200,000 objects) costs ~90 ms of CPU, about ten stand-in steps, and lands in
whichever round reaches its allocation count: a few such collections decided the earlier
runs' ratios. The server freezes its start-up heap after warm-up (server/cli.py), so the
arms do too (`--no-gc-freeze`: not).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scheduler import attach_events, spread  # noqa: E402
from step_counters import StepCounters  # noqa: E402

from radixserve.engine.null_model import NullRunner, null_core  # noqa: E402
from radixserve.engine.request import new_request  # noqa: E402
from radixserve.engine.sampling_params import SamplingParams  # noqa: E402

RUNNING = 256
PROMPT, SHARED = 256, 128


def tiny_model(directory: Path):
    """A 2-layer Llama (hidden 64) with random weights, saved and loaded as a user's
    checkpoint would be (tests/model/tiny_models.py)."""
    from radixserve.model import load_model
    from tests.model.tiny_models import hf_config, random_hf_model, save_hf_dir

    config = hf_config("llama", max_position_embeddings=1024)
    save_hf_dir(directory, random_hf_model(config))
    return load_model(str(directory), dtype="float32")


class Arm:
    """One engine core at 256 running on the churn, with or without events, kept across
    rounds; `round(steps)` runs and measures that many steps."""

    def __init__(self, loaded, events: bool, page_size: int, seed: int = 0,
                 clock=time.monotonic):
        self.page_size = page_size
        pages = RUNNING * 320 // page_size
        if loaded is None:
            self.core = null_core(num_pages=pages, page_size=page_size,
                                  max_running=RUNNING, token_budget=8192)
            self.runner = NullRunner(page_size=page_size)
            self.kv = attach_events(self.core, clock=clock) if events else None
            self.engine = None
        else:
            from radixserve.engine.config import EngineConfig
            from radixserve.engine.engine import Engine

            config = EngineConfig(kv_cache_tokens=pages * page_size, page_size=page_size,
                                  max_running_requests=RUNNING, chunked_prefill_size=8192,
                                  warmup_tokens=0,
                                  kv_events="tcp://127.0.0.1:*" if events else None)
            self.engine = Engine(config, loaded)
            self.core, self.runner = self.engine.core, self.engine.runner
            self.kv = self.engine.kv_events
        self.vocab = 250 if loaded is None else loaded.config.vocab_size - 3
        self.rng = random.Random(seed)
        self.prefix = [self.rng.randrange(3, self.vocab) for _ in range(SHARED)]
        self.next_id = 0
        self.sink: list = []

    def _top_up(self) -> None:
        """Keep requests waiting: the churn admits ~12 a step."""
        while len(self.core.scheduler.waiting) < 32:
            params = SamplingParams(max_tokens=self.rng.randint(8, 48), temperature=0.0,
                                    ignore_eos=True)
            prompt = self.prefix + [self.rng.randrange(3, self.vocab)
                                    for _ in range(PROMPT - SHARED)]
            self.core.add(new_request(f"r{self.next_id}", prompt, params, None,
                                      self.sink.append, self.page_size))
            self.next_id += 1

    def step(self) -> int:
        """One step; returns how many ran in it."""
        self._top_up()
        plan = self.core.schedule()
        running = len(self.core.scheduler.running)
        self.core.complete(plan, self.runner.execute(plan.batch))
        if self.kv is not None:
            self.kv.after_step()        # as the engine's loop (flushed when it goes idle)
        self.sink.clear()
        return running

    def round(self, steps: int, warmup: int) -> dict:
        for _ in range(warmup):
            self.step()
        if self.kv is not None:
            self.kv.publisher.wait_idle(timeout_s=60)
        wakes0 = self._child_wakes()
        counters, walls, cpu, running = StepCounters(), [], 0.0, []
        counters.start()
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            running.append(self.step())
            cpu += time.thread_time() - c0
            walls.append(time.perf_counter() - t0)
        counted = counters.stop(steps)
        assert min(running) == RUNNING, f"{min(running)} running: the churn must keep 256"
        return {"cpu_us": cpu / steps * 1e6, "wall_us": statistics.median(walls) * 1e6,
                "child_wakes": (self._child_wakes() - wakes0) / steps, **counted}

    def _child_wakes(self) -> int:
        pub = self.kv.publisher if self.kv is not None else None
        return pub.child_wakes() if hasattr(pub, "child_wakes") else 0

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()


COUNTERS = (("gc0", "gc gen0/step"), ("gc1", "gc gen1/step"), ("gc2", "gc gen2/step"),
            ("gc_us", "gc cpu us/step"), ("blocks", "net blocks/step"),
            ("vcsw", "voluntary ctx sw/step"), ("ivcsw", "involuntary ctx sw/step"),
            ("child_wakes", "publisher wakes/step"))


class BusyLoop:
    """A Python busy loop in a process of its own (`--control-busy`): what any work on the
    other core, the publisher's included, costs the engine's thread on this machine."""

    def __enter__(self):
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()


def compare(name: str, loaded, page_size: int, pairs: int, steps: int, warmup: int,
            freeze: bool, control_busy: bool = False) -> None:
    arms = {events: Arm(loaded, events, page_size) for events in (False, True)}
    for arm in arms.values():       # reach the steady churn
        arm.round(1, warmup * 2)
    if freeze:
        gc.collect()
        gc.freeze()
    rows: dict[str, list[float]] = {}
    try:
        for i in range(pairs):
            runs = {events: arms[events].round(steps, warmup)
                    for events in ((False, True) if i % 2 == 0 else (True, False))}
            off, on = runs[False], runs[True]
            rows.setdefault("engine thread cpu on/off", []).append(on["cpu_us"] / off["cpu_us"])
            rows.setdefault("wall on/off (median step)", []).append(
                on["wall_us"] / off["wall_us"])
            if control_busy:
                with BusyLoop():
                    busy = arms[False].round(steps, warmup)
                rows.setdefault("control: off, other core busy / off", []).append(
                    busy["cpu_us"] / off["cpu_us"])
            for side, run in (("off", off), ("on", on)):
                rows.setdefault(f"cpu us/step {side}", []).append(run["cpu_us"])
                for key, label in COUNTERS:
                    rows.setdefault(f"{label} {side}", []).append(run[key])
    finally:
        for arm in arms.values():
            arm.close()
        if freeze:
            gc.unfreeze()
    for label, values in rows.items():
        med, low, high, iqr = spread(values)
        ratio = "/ off" in label or "on/off" in label
        fmt = ".4f" if ratio or "/step" in label and "us" not in label else ".1f"
        print(f"{name:>9} {page_size:>5} {label:>30} {med:>9{fmt}} {low:>9{fmt}} "
              f"{high:>9{fmt}} {iqr:>8{fmt}}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=24, help="off/on pairs per setting")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round")
    parser.add_argument("--models", default="null,tiny",
                        help="null (the stand-in forward), tiny (a real forward)")
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="leave the start-up heap to the collector (by default it is "
                             "frozen once the arms are built, as `radixserve serve` does "
                             "after its warm-up: server/cli.py freeze_startup_heap)")
    parser.add_argument("--control-busy", action="store_true",
                        help="also run each pair's events-off arm beside a busy loop on the "
                             "other core: the cost to the engine of any work there")
    args = parser.parse_args()
    print(f"256 running, shared-prefix churn; {args.pairs} off/on pairs of {args.steps} "
          f"timed steps; gc.freeze: {args.gc_freeze}")
    print(f"{'model':>9} {'page':>5} {'measure':>30} {'median':>9} {'95% low':>9} "
          f"{'95% high':>9} {'IQR':>8}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            loaded = tiny_model(Path(tmp) / "tiny") if name == "tiny" else None
            for page_size in map(int, args.page_sizes.split(",")):
                compare(name, loaded, page_size, args.pairs, args.steps, args.warmup,
                        args.gc_freeze, args.control_busy)
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
