"""Scheduler: decides what each step computes. Pure Python, synchronous, event-loop owned.

One step = decodes of the running sequences (one token each), continued prefill chunks,
then new admissions, all within a token budget. Admission is by memory: free + evictable
pages must cover the new tokens plus a decode reserve for everything running. When a
decode cannot get a page, the sequence with the least progress is preempted: its computed
KV goes into the tree, so its recompute later hits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixserve.attention.metadata import SeqSpan
from radixserve.cache.page_allocator import OutOfPages
from radixserve.engine.batch import StepBatch
from radixserve.engine.outputs import EngineStats, RequestOutput, Usage
from radixserve.engine.request import Request, Sequence, SeqStatus
from radixserve.engine.sampler import SampleResult
from radixserve.engine.seq_memory import SequenceMemory

DECODE_RESERVE_TOKENS = 16      # per running sequence, held back from admission
LPM_QUEUE_LIMIT = 128           # beyond this many waiting, lpm falls back to arrival order
AGING_TOKENS_PER_STEP = 32      # lpm: a waiting step is worth this many cached tokens
SHARED_PREFIX_PROBE = 32        # tokens compared to spot a prefix another request computes


def _progress_order(seq: Sequence) -> tuple:
    return (-seq.num_generated, seq.request.arrival_time)


@dataclass
class SchedulerConfig:
    page_size: int
    max_running: int
    token_budget: int
    policy: str = "lpm"
    max_model_len: int = 8192


@dataclass
class StepPlan:
    batch: StepBatch
    seqs: list[Sequence] = field(default_factory=list)     # in span order
    new_lens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: SequenceMemory, stats: EngineStats):
        self.config = config
        self.memory = memory
        self.stats = stats
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.schedule_seconds = 0.0

    # ---- intake -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.arrival_step = self.step
        self.requests[request.request_id] = request
        self.waiting.extend(request.sequences)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.aborted = True
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_live(self) -> int:
        return len(self.requests)

    # ---- building a step ----------------------------------------------------------

    def schedule(self) -> StepPlan:
        started = time.perf_counter()
        self.step += 1
        self._retire_aborted()
        budget = self.config.token_budget
        work: list[tuple[Sequence, int]] = []

        # Most progressed first, so preemption victims come from the tail. Sorting costs
        # little but is only needed when this step's decodes could run out of pages.
        if self.memory.available_pages() < 2 * len(self.running) + budget:
            self.running.sort(key=_progress_order)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.remaining == 1:
                want = 1
            elif budget <= 0:
                i += 1
                continue
            else:
                want = min(seq.remaining, budget)
            if not self._reserve_or_preempt(seq, want):
                continue            # seq itself was preempted; the list shifted
            budget -= want
            work.append((seq, want))
            i += 1

        self._admit(budget, work)
        # Multi-token spans first, single-token ones after (the layout attention expects).
        work.sort(key=lambda item: item[1] == 1)
        plan = StepPlan(batch=StepBatch())
        for seq, n in work:
            self._add_span(plan, seq, n)
        self.schedule_seconds += time.perf_counter() - started
        return plan

    def _reserve_or_preempt(self, seq: Sequence, want: int) -> bool:
        """Get pages for `want` more tokens of a running sequence, preempting from the tail."""
        while True:
            try:
                self.memory.reserve(seq, want)
                return True
            except OutOfPages:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False

    def _admit(self, budget: int, work: list[tuple[Sequence, int]]) -> None:
        if not self.waiting or budget <= 0:
            return
        candidates = self._ordered_waiting()
        reserve_pages = self.memory.pages_for(
            sum(min(DECODE_RESERVE_TOKENS, s.params.max_tokens - s.num_generated)
                for s in self.running))
        admitted: set[int] = set()
        for seq, cached in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            if self._shares_prefix_in_flight(seq, cached):
                continue
            try:
                hit = self.memory.admit(seq)
            except OutOfPages:
                break
            need = self.memory.pages_for(len(seq.token_ids) + DECODE_RESERVE_TOKENS) - len(seq.pages)
            if need + reserve_pages > self.memory.available_pages():
                self.memory.release(seq, keep=False)
                break
            chunk = min(seq.remaining, budget)
            try:
                self.memory.reserve(seq, chunk)
            except OutOfPages:
                self.memory.release(seq, keep=False)
                break
            self.stats.prefix_query_tokens += len(seq.token_ids)
            self.stats.prefix_hit_tokens += hit
            if seq.cached_tokens is None:
                seq.cached_tokens = hit
                self.stats.prompt_tokens += seq.prompt_len
            else:
                self.stats.recompute_hit_tokens += hit
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.add(id(seq))
            reserve_pages += self.memory.pages_for(DECODE_RESERVE_TOKENS)
            budget -= chunk
            work.append((seq, chunk))
        if admitted:
            self.waiting = [s for s in self.waiting if id(s) not in admitted]

    def _ordered_waiting(self) -> list[tuple[Sequence, int | None]]:
        """Waiting sequences in admission order, with their cached prefix when it was
        looked up for the ordering (lpm), so admission need not look it up again."""
        if self.config.policy == "fcfs" or len(self.waiting) > LPM_QUEUE_LIMIT:
            ordered = sorted(self.waiting, key=lambda s: (s.request.arrival_time, s.index))
            return [(s, None) for s in ordered]
        step = self.step
        scored = []
        for s in self.waiting:
            cached = self.memory.cached_prefix_len(s)
            aged = cached + AGING_TOKENS_PER_STEP * (step - s.request.arrival_step)
            scored.append(((-aged, s.request.arrival_time, s.index), s, cached))
        scored.sort(key=lambda item: item[0])
        return [(s, cached) for _, s, cached in scored]

    def _shares_prefix_in_flight(self, seq: Sequence, cached: int | None) -> bool:
        """True when a running sequence is computing the very prefix `seq` would compute.

        Deferring `seq` lets it hit those pages once they are inserted (after each chunk),
        instead of computing the same tokens twice in parallel.
        """
        if not self.memory.use_cache:
            return False
        start = self.memory.cached_prefix_len(seq) if cached is None else cached
        probe = seq.token_ids[start: start + SHARED_PREFIX_PROBE]
        if len(probe) < 2:
            return False
        for other in self.running:
            if (other.in_prefill and other.request.namespace == seq.request.namespace
                    and other.token_ids[start: start + len(probe)] == probe):
                return True
        return False

    def _add_span(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        batch = plan.batch
        samples = start + n == len(seq.token_ids)
        if n == 1:
            batch.input_ids.append(seq.token_ids[start])
            batch.positions.append(start)
        else:
            batch.input_ids.extend(seq.token_ids[start: start + n])
            batch.positions.extend(range(start, start + n))
        batch.spans.append(SeqSpan(seq.pages, start, n))
        batch.copies.extend(self.memory.take_copy_orders(seq))
        if samples:
            batch.sample_rows.append(len(batch.spans) - 1)
            batch.sample_params.append(seq.request.params)
            batch.generators.append(seq.generator)
        plan.seqs.append(seq)
        plan.new_lens.append(n)
        plan.samples.append(samples)

    # ---- after the forward pass ---------------------------------------------------

    def complete(self, plan: StepPlan, result: SampleResult) -> None:
        """Advance every sequence of the step, sample, stream, retire finished ones."""
        started = time.perf_counter()
        now = time.monotonic()
        row = 0
        for seq, n, samples in zip(plan.seqs, plan.new_lens, plan.samples):
            token = result.token_ids[row] if samples else None
            logprob = result.logprobs[row] if samples else None
            row += samples
            if seq.status is not SeqStatus.RUNNING:
                continue        # preempted or retired meanwhile
            seq.num_computed += n
            if seq.request.aborted:
                self._finish(seq, "abort", None, now)
                continue
            if not samples:
                self.memory.commit(seq)     # insert after each prefill chunk
                continue
            if n > 1:
                self.memory.commit(seq)
            self._append_token(seq, token, logprob, now)
        self.stats.steps += 1
        self.schedule_seconds += time.perf_counter() - started

    def _append_token(self, seq: Sequence, token: int, logprob, now: float) -> None:
        seq.token_ids.append(token)
        seq.num_generated += 1
        self.stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        delta = seq.text_stream.push(token, seq.num_generated)
        text = delta.text
        if not delta.finished and len(seq.token_ids) >= self.config.max_model_len:
            end = seq.text_stream.finish("length")     # the context is full
            text += end.text
            delta = end
        finished, reason, stop_reason = delta.finished, delta.finish_reason, delta.stop_reason
        out = self._output(seq, [token], text, now)
        out.logprobs = [logprob] if logprob is not None else None
        if finished:
            self._retire(seq, reason, keep=True)
            self._mark_final(out, seq, reason, stop_reason)
        seq.request.emit(out)

    def fail(self, plan: StepPlan, error: BaseException) -> None:
        """A step raised: its sequences fail, their pages (maybe half-written) are freed."""
        self._fail_sequences(plan.seqs, error)

    def fail_all(self, error: BaseException) -> None:
        """The scheduler itself raised: fail every live sequence rather than hang them."""
        self._fail_sequences(self.running + self.waiting, error)

    def _fail_sequences(self, seqs: list[Sequence], error: BaseException) -> None:
        now = time.monotonic()
        message = f"{type(error).__name__}: {error}"
        for seq in seqs:
            if seq.status is SeqStatus.FINISHED:
                continue
            self._retire(seq, "error", keep=False)
            out = self._output(seq, [], "", now)
            self._mark_final(out, seq, "error", None)
            out.error = message
            seq.request.emit(out)

    # ---- retiring -----------------------------------------------------------------

    def _retire_aborted(self) -> None:
        if not any(r.aborted for r in self.requests.values()):
            return
        now = time.monotonic()
        for seq in [s for s in self.waiting + self.running if s.request.aborted]:
            self._finish(seq, "abort", None, now)

    def _finish(self, seq: Sequence, reason: str, stop_reason, now: float) -> None:
        self._retire(seq, reason, keep=reason != "error")
        out = self._output(seq, [], "", now)
        self._mark_final(out, seq, reason, stop_reason)
        seq.request.emit(out)

    def _retire(self, seq: Sequence, reason: str, keep: bool) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.memory.release(seq, keep=keep)
        seq.status = SeqStatus.FINISHED
        finished = self.stats.requests_finished
        finished[reason] = finished.get(reason, 0) + 1
        if seq.request.finished:
            self.requests.pop(seq.request.request_id, None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.memory.release(seq, keep=True)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.insert(0, seq)

    def _output(self, seq: Sequence, tokens: list[int], text: str, now: float) -> RequestOutput:
        return RequestOutput(request_id=seq.request.request_id, index=seq.index,
                             token_ids=tokens, text=text,
                             arrival_time=seq.request.arrival_time,
                             first_token_time=seq.first_token_time, time=now)

    @staticmethod
    def _mark_final(out: RequestOutput, seq: Sequence, reason: str, stop_reason) -> None:
        out.finished = True
        out.finish_reason = reason
        out.stop_reason = stop_reason
        out.usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated,
                          cached_tokens=seq.cached_tokens or 0)
