"""EngineCore: one step's bookkeeping around the forward pass, without asyncio or torch.

A step is: `schedule()` (the scheduler picks the work; aborted samples get their final
event), the forward pass (the caller's: the engine runs it on the compute thread, tests run
a null model inline), then `complete(plan, result)` (the scheduler applies the result, the
output processor streams it, and the samples its stop checks ended are retired). Errors go
to `fail_step` / `fail_all`. The engine, the scheduler tests and bench_scheduler all drive
steps through this one class.
"""

from __future__ import annotations

import time

from radixserve.engine.batch import StepResult
from radixserve.engine.output_processor import OutputProcessor
from radixserve.engine.request import Request
from radixserve.engine.scheduler import Scheduler, StepPlan


class EngineCore:
    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor):
        self.scheduler = scheduler
        self.outputs = outputs
        self.bookkeeping_seconds = 0.0      # in schedule() and complete(), all steps


    def add(self, request: Request) -> None:
        self.outputs.add(request)
        self.scheduler.add(request)

    def schedule(self) -> StepPlan:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.outputs.finish(plan.aborted, "abort", time.monotonic())
        self.bookkeeping_seconds += time.perf_counter() - started
        return plan

    def complete(self, plan: StepPlan, result: StepResult) -> None:
        """Apply a step's result: scheduler state first, then the outputs, whose stop checks
        say which samples the scheduler retires."""
        started = time.perf_counter()
        update = self.scheduler.complete(plan, result.sample)
        now = time.monotonic()
        self.outputs.finish(update.aborted, "abort", now)
        self.scheduler.finish(self.outputs.on_tokens(update, now))
        self.bookkeeping_seconds += time.perf_counter() - started

    def fail_step(self, plan: StepPlan, error: BaseException) -> None:
        """The forward pass raised: its samples end with "error"."""
        self.outputs.finish(self.scheduler.fail(plan), "error", time.monotonic(), error)

    def fail_all(self, error: BaseException) -> None:
        """Bookkeeping raised: every live sample ends with "error" rather than hang."""
        self.outputs.finish(self.scheduler.fail_all(), "error", time.monotonic(), error)
