"""Counters of what an engine step pays beyond its own code, for bench_scheduler.py's
`--kv-events steady`: steadier than timings on a busy machine, and they name a cause.

Over a round of steps, on the thread that runs them:
- Python's cyclic GC: collections per generation and the CPU inside them (`gc.callbacks`
  brackets each collection; the engine's thread runs them, wherever the allocation that
  triggers one happens to be);
- the net change of allocated memory blocks (`sys.getallocatedblocks`) per step;
- voluntary and involuntary context switches of this thread (`getrusage(RUSAGE_THREAD)`):
  a voluntary one is a wait (the GIL taken by another thread, a blocking call), an
  involuntary one a preemption (another process wanted this core).
"""

from __future__ import annotations

import gc
import resource
import sys
import time

__all__ = ["StepCounters"]


class StepCounters:
    """`start()` before the timed steps, `stop(steps)` after: returns per-step figures."""

    def __init__(self):
        self._collections = [0, 0, 0]
        self._gc_cpu = 0.0
        self._gc_started = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            self._collections[info["generation"]] += 1
            self._gc_cpu += time.thread_time() - self._gc_started

    def start(self) -> None:
        self._collections = [0, 0, 0]
        self._gc_cpu = 0.0
        self._blocks = sys.getallocatedblocks()
        self._usage = resource.getrusage(resource.RUSAGE_THREAD)
        gc.callbacks.append(self._on_gc)

    def stop(self, steps: int) -> dict[str, float]:
        gc.callbacks.remove(self._on_gc)
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        blocks = sys.getallocatedblocks() - self._blocks
        gen0, gen1, gen2 = (n / steps for n in self._collections)
        return {"gc0": gen0, "gc1": gen1, "gc2": gen2, "gc_us": self._gc_cpu / steps * 1e6,
                "blocks": blocks / steps,
                "vcsw": (usage.ru_nvcsw - self._usage.ru_nvcsw) / steps,
                "ivcsw": (usage.ru_nivcsw - self._usage.ru_nivcsw) / steps}
