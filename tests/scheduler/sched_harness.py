"""A scheduler test bench: the engine's real step machinery over a null model, no torch.

Each `step()` runs one engine step (schedule, null forward, complete) and then checks page
conservation, so every scenario is checked after every step, not only at its end. It also
records what each step did (admitted, preempted, span sizes) for the tests to assert on.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from radixserve.engine.null_model import NullRunner, null_core
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.request import Request, SeqState, SeqStatus, new_request
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import StepPlan


@dataclass
class StepRecord:
    step: int
    plan: StepPlan
    admitted: list[SeqState]              # waiting before the step, running in it
    preempted: list[SeqState]             # running before the step, waiting after it
    running_before: list[SeqState]
    generated_before: dict[SeqState, int]
    remaining_before: dict[SeqState, int]
    waiting_after: list[SeqState]
    waiting_before: list[SeqState]

    def new_lens(self, seq: SeqState) -> list[int]:
        return [n for s, n in zip(self.plan.seqs, self.plan.new_lens) if s is seq]

    @property
    def num_tokens(self) -> int:
        return sum(self.plan.new_lens)


@dataclass
class Bench:
    page_size: int = 1
    num_pages: int = 4096
    max_running: int = 256
    token_budget: int = 2048
    policy: str = "lpm"
    use_cache: bool = True
    seed: int = 0
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    history: list[StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.core = null_core(num_pages=self.num_pages, page_size=self.page_size,
                              max_running=self.max_running, token_budget=self.token_budget,
                              policy=self.policy, use_cache=self.use_cache)
        self.scheduler = self.core.scheduler
        self.memory = self.scheduler.memory
        self.runner = NullRunner(page_size=self.page_size, seed=self.seed)
        self._ids = itertools.count()
        self._clock = itertools.count()

    # ---- requests -----------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int = 4, n: int = 1,
               request_id: str | None = None, **params) -> Request:
        request_id = request_id or f"r{next(self._ids)}"
        sampling = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, **params)
        self.outputs[request_id] = []
        # A logical arrival clock: ties and order never depend on the machine's speed.
        request = new_request(request_id, list(prompt), sampling, None,
                              self.outputs[request_id].append, self.page_size,
                              arrival_time=float(next(self._clock)))
        self.core.add(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def finished(self, request_id: str) -> bool:
        outs = self.outputs[request_id]
        return sum(o.finished for o in outs) == len({o.index for o in outs}) > 0 and \
            request_id not in self.scheduler.requests

    def final(self, request_id: str, index: int = 0) -> RequestOutput:
        (out,) = [o for o in self.outputs[request_id] if o.finished and o.index == index]
        return out

    # ---- stepping -----------------------------------------------------------------

    def step(self) -> StepRecord:
        sched = self.scheduler
        waiting_before = list(sched.waiting)
        was_waiting = set(waiting_before)
        running_before = list(sched.running)
        generated_before = {s: s.num_generated for s in running_before}
        remaining_before = {s: s.remaining for s in running_before}
        plan = self.core.schedule()
        if plan.batch:
            self.core.complete(plan, self.runner.execute(plan.batch))
        record = StepRecord(
            step=sched.step, plan=plan,
            admitted=[s for s in plan.seqs if s in was_waiting],
            preempted=[s for s in running_before if s.status is SeqStatus.WAITING],
            running_before=running_before, generated_before=generated_before,
            remaining_before=remaining_before, waiting_after=list(sched.waiting),
            waiting_before=waiting_before)
        self.history.append(record)
        self.check()
        return record

    def drain(self, max_steps: int = 10_000) -> Iterator[StepRecord]:
        """Step until nothing is left, yielding each step's record (fails if that takes
        more than max_steps)."""
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            yield self.step()
        raise AssertionError(f"still busy after {max_steps} steps")

    def run(self, max_steps: int = 10_000) -> None:
        for _ in self.drain(max_steps):
            pass

    def check(self) -> None:
        """Page conservation; no lock held and no output state left once idle."""
        live = self.scheduler.running + self.scheduler.waiting
        self.memory.check(live)
        if not live:
            assert self.memory.tree.locked_tokens == 0, "locks held with no live request"
            assert self.core.outputs.num_open == 0, "a sample never got its final event"

    def available_pages(self) -> int:
        """Free + evictable pages: what admission compares against."""
        return self.memory.available_pages()


def random_prompt(rng: random.Random, length: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]
