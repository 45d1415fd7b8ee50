"""Scheduler: decides what each step computes. Pure Python, synchronous, event-loop owned.

It only schedules: output (detokenizing, stop checks, events, usage) is the output
processor's (engine/output_processor.py), which tells the engine which sequences to
`finish`. It imports no torch, so it is tested against a null model in milliseconds.

One step = decodes of the running sequences (one token each), continued prefill chunks,
then new admissions, all within a token budget. Admission is by memory: free + evictable
pages must cover the new tokens plus a decode reserve for everything running. When a
decode cannot get a page, the sequence with the least progress is preempted: its computed
KV goes into the tree, so its recompute later hits.

lpm's wait bound (`max_wait_steps`, docs/conversations.md): the oldest overdue sequence goes
first, never deferred, with a reserved share of the budget until its prompt is computed;
memory and slots are kept for it, and after PREEMPT_AFTER_BOUNDS bounds younger running
sequences are preempted to make room.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from radixserve.attention.spans import SeqSpan
from radixserve.cache.page_allocator import OutOfPages
from radixserve.cache.tiers import ReadPending
from radixserve.engine.batch import SampleResult, StepBatch, StepUpdate
from radixserve.engine.outputs import EngineStats
from radixserve.engine.request import Request, SeqState, SeqStatus
from radixserve.engine.seq_memory import SequenceMemory
from radixserve.engine.wait_bound import (LPM_MAX_WAIT_STEPS, PREEMPT_AFTER_BOUNDS,
                                          oldest_overdue, overdue_first, overdue_share,
                                          wait_order, youngest_after)

DECODE_RESERVE_TOKENS = 16      # per running sequence, held back from admission
LPM_QUEUE_LIMIT = 128           # beyond this many waiting, lpm falls back to arrival order
AGING_TOKENS_PER_STEP = 32      # lpm: a waiting step is worth this many cached tokens
SHARED_PREFIX_PROBE = 32        # tokens compared to spot a prefix another request computes


def _progress_order(seq: SeqState) -> tuple:
    return (-seq.num_generated, seq.request.arrival_time)


def _aged_score(seq: SeqState, cached: int, step: int) -> int:
    """lpm's score: minus the prefill work left, plus the credit for steps waited."""
    waited = step - seq.waiting_since
    return cached - len(seq.token_ids) + AGING_TOKENS_PER_STEP * waited


@dataclass
class SchedulerConfig:
    page_size: int
    max_running: int
    token_budget: int
    policy: str = "lpm"
    max_wait_steps: int = LPM_MAX_WAIT_STEPS   # lpm's starvation bound (see _ordered_waiting)


@dataclass
class StepPlan:
    batch: StepBatch
    seqs: list[SeqState] = field(default_factory=list)     # in span order
    new_lens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    aborted: list[SeqState] = field(default_factory=list)  # retired before the step
    deferred: list[SeqState] = field(default_factory=list)  # held back: prefix in flight
    admission_stop: str = ""    # why admission stopped with some waiting: budget/running cap/memory


class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: SequenceMemory, stats: EngineStats):
        self.config = config
        self.memory = memory
        self.stats = stats
        self.waiting: list[SeqState] = []
        self.running: list[SeqState] = []
        self.requests: dict[str, Request] = {}
        self.step = 0
        self._overdue_prefill: SeqState | None = None   # admitted overdue, prompt left

    # ---- intake -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.arrival_step = self.step
        for seq in request.sequences:
            seq.waiting_since = self.step
        self.requests[request.request_id] = request
        self.waiting.extend(request.sequences)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.aborted = True
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self.memory.has_orders()

    @property
    def num_live(self) -> int:
        return len(self.requests)

    @property
    def num_waiting_requests(self) -> int:
        """Requests with a sample waiting (the queue cap counts requests, not samples)."""
        return len({id(s.request) for s in self.waiting})

    @property
    def num_running_requests(self) -> int:
        """Requests with a sample running."""
        return len({id(s.request) for s in self.running})

    # ---- building a step ----------------------------------------------------------

    def schedule(self) -> StepPlan:
        self.step += 1
        aborted = self._retire_aborted()
        budget = self.config.token_budget
        work: list[tuple[SeqState, int]] = []

        # The wait bound: the overdue sequence served now (admitted with prompt left, or
        # the oldest waiting) gets a share of the budget other prefill chunks leave alone.
        head = self._overdue_head()
        held = 0 if head is None else min(head.remaining,
                                          overdue_share(self.config.token_budget))
        # Most progressed first, so preemption victims come from the tail. Sorting costs
        # little but is only needed when this step's decodes could run out of pages.
        if self.memory.available_pages() < 2 * len(self.running) + budget:
            self.running.sort(key=_progress_order)
        preemptions_before = self.stats.preemptions
        self.memory.evict_ahead(len(self.running))
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.remaining == 1:
                want = 1
            elif seq is head:
                want, held = min(seq.remaining, budget), 0
            elif budget - held <= 0:
                i += 1
                continue
            else:
                want = min(seq.remaining, budget - held)
            if not self._reserve_or_preempt(seq, want):
                continue            # seq itself was preempted; the list shifted
            budget -= want
            work.append((seq, want))
            i += 1

        # No admissions in a step that had to preempt (as vLLM): memory is short, and a
        # victim re-admitted at once would only recompute what it just gave back.
        preempted = self.stats.preemptions != preemptions_before
        deferred, stop = ([], "preempted") if preempted else self._admit(budget, work, head)
        # Multi-token spans first, single-token ones after (the layout attention expects).
        work.sort(key=lambda item: item[1] == 1)
        plan = StepPlan(batch=StepBatch(), aborted=aborted, deferred=deferred,
                        admission_stop=stop)
        for seq, n in work:
            self._add_span(plan, seq, n)
        plan.batch.moves = self.memory.take_moves()     # tiers: before copies and compute
        plan.batch.peer = self.memory.take_peer_orders()
        return plan

    def _reserve_or_preempt(self, seq: SeqState, want: int) -> bool:
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

    def _admit(self, budget: int, work: list[tuple[SeqState, int]],
               head: SeqState | None = None) -> tuple[list[SeqState], str]:
        """Admit waiting sequences in policy order until budget, running cap or memory
        stops it; return those held back because a running one computes their prefix, and
        what stopped admission ("" when nothing did). `head`, the oldest overdue sequence
        (first in lpm's order), is never deferred; while memory or the running cap keeps it
        out nothing else is admitted, and after PREEMPT_AFTER_BOUNDS bounds younger running
        sequences are preempted to make room for it (_admit_overdue)."""
        deferred: list[SeqState] = []
        if not self.waiting:
            return deferred, ""
        if budget <= 0:
            return deferred, "budget"
        candidates = self._ordered_waiting()
        reserve_pages = self._decode_reserve_pages()
        admitted: set[int] = set()
        stop = ""
        for seq, cached in candidates:
            if budget <= 0:
                stop = "budget"
                break
            if seq is not head and len(self.running) >= self.config.max_running:
                stop = "running cap"
                break
            if seq is not head and self._shares_prefix_in_flight(seq, cached):
                deferred.append(seq)
                continue
            try:
                if seq is head:
                    hit, budget = self._admit_overdue(seq, budget, work)
                    reserve_pages = self._decode_reserve_pages()
                else:
                    hit = self._admit_within(seq, reserve_pages)
            except ReadPending:     # its prefix's disk pages are being read: it waits
                continue
            if hit is None:
                full = seq is head and len(self.running) >= self.config.max_running
                stop = "running cap" if full else "memory"
                break
            chunk = min(seq.remaining, budget)
            try:
                self.memory.reserve(seq, chunk)
            except OutOfPages:
                self.memory.release(seq, keep=False)
                stop = "memory"
                break
            self.stats.prefix_query_tokens += len(seq.token_ids)
            self.stats.prefix_hit_tokens += hit
            if seq.prompt_cache_hit is None:
                seq.prompt_cache_hit = hit
                seq.miss = self.memory.explain_miss(seq)
                self.stats.prompt_tokens += seq.prompt_len
            else:
                self.stats.recompute_hit_tokens += hit
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.add(id(seq))
            if seq is head:
                self._overdue_prefill = seq     # keeps its share until its prompt is done
            reserve_pages += self.memory.pages_for(DECODE_RESERVE_TOKENS)
            budget -= chunk
            work.append((seq, chunk))
        if admitted:
            self.waiting = [s for s in self.waiting if id(s) not in admitted]
        return deferred, stop

    def _decode_reserve_pages(self) -> int:
        """Pages admission leaves for the running sequences' next decodes."""
        return self.memory.pages_for(
            sum(min(DECODE_RESERVE_TOKENS, s.params.max_tokens - s.num_generated)
                for s in self.running))

    def _admit_overdue(self, seq: SeqState, budget: int, work: list[tuple[SeqState, int]]
                       ) -> tuple[int | None, int]:
        """Lease the oldest overdue sequence's prefix, preempting running sequences that
        arrived after it (youngest first; their computed KV stays cached) while the running
        cap or memory keeps it out. Returns (cached tokens or None, the budget left):
        None only when no younger sequence is left to preempt. A victim's span in this step
        is dropped and its tokens go back to `budget`. Raises ReadPending as admit does."""
        while True:
            if len(self.running) < self.config.max_running:
                hit = self._admit_within(seq, self._decode_reserve_pages())
                if hit is not None:
                    return hit, budget
            waited = self.step - seq.waiting_since
            if waited < PREEMPT_AFTER_BOUNDS * self.config.max_wait_steps:
                return None, budget     # memory is reserved for it: nothing else goes in
            victim = youngest_after(self.running, seq)
            if victim is None:
                return None, budget
            for k, (other, n) in enumerate(work):
                if other is victim:
                    budget += n
                    del work[k]
                    break
            self._preempt(victim)
            # Its wait starts again: a victim overdue at once would preempt in turn, and
            # the cascade would turn lpm into arrival order (and evict the shared prefixes).
            victim.waiting_since = self.step

    def _overdue_head(self) -> SeqState | None:
        """The overdue sequence the wait bound serves this step: the one admitted overdue
        while its prompt is not all computed, else the oldest overdue one waiting."""
        head = self._overdue_prefill
        if head is not None and head.status is SeqStatus.RUNNING and head.in_prefill:
            return head
        self._overdue_prefill = None
        return self._oldest_overdue()

    def _oldest_overdue(self) -> SeqState | None:
        """lpm: the overdue waiting sequence that has waited longest (None under fcfs)."""
        if self.config.policy != "lpm" or not self.waiting:
            return None
        return oldest_overdue(self.waiting, self.step, self.config.max_wait_steps)

    def _admit_within(self, seq: SeqState, reserve_pages: int) -> int | None:
        """Lease `seq`'s cached prefix if its prompt then fits beside `reserve_pages`;
        returns the cached tokens, or None (nothing held) when memory is short.

        With nothing running, no page will come free by waiting: if the hit's own lock is
        what keeps the prompt out (a copy-on-write match locks its whole edge, which a tiny
        pool may need back), the sequence is admitted without the hit instead of retrying
        the same admission every step forever.
        """
        for reuse in (True, False):
            try:
                hit = self.memory.admit(seq, reuse_cache=reuse)
            except OutOfPages:
                return None
            need = self.memory.pages_for(len(seq.token_ids) + DECODE_RESERVE_TOKENS) - len(seq.pages)
            if need + reserve_pages <= self.memory.available_pages():
                return hit
            self.memory.release(seq, keep=False)
            if not hit or self.running:
                return None
        return None

    def _ordered_waiting(self) -> list[tuple[SeqState, int | None]]:
        """Waiting sequences in admission order, with their cached prefix when it was
        looked up for the ordering (lpm), so admission need not look it up again.

        lpm orders by the prefill work left (prompt minus cached prefix, fewest tokens
        first; for prompts of one length that is the longest cached prefix first), with 32
        tokens of credit per step waited. A sequence that has waited `max_wait_steps` steps
        is *overdue*: each step, the oldest overdue ones go before every scored one, as
        many as fit in OVERDUE_BUDGET_SHARE of the step's token budget (always at least
        one), and admission stops behind one that does not fit in memory, so the pages
        that free up go to it. Overdue ones beyond the share keep their scored place: a
        burst of overdue requests cannot turn lpm into arrival order (which would evict
        the shared prefixes and make everything overdue).

        Requests sharing a `prompt_cache_key` are ordered as one group: each takes the
        group's best score (a running member counts with its score at admission), and the
        group stays together (its first arrival breaks ties), so they are admitted one
        after another and share what the first computes."""
        if self.config.policy == "fcfs" or len(self.waiting) > LPM_QUEUE_LIMIT:
            ordered = sorted(self.waiting, key=lambda s: (s.request.arrival_time, s.index))
            return [(s, None) for s in ordered]
        step = self.step
        looked = [(s, self.memory.cached_prefix_len(s)) for s in self.waiting]
        groups: dict[str, tuple[int, float]] = {}   # cache_key -> (best score, first arrival)
        for s in self.running:      # a group being served keeps its admission score
            if (key := s.params.cache_key) is not None:
                best, first = groups.get(key, (-s.prompt_len, s.request.arrival_time))
                groups[key] = (max(best, (s.prompt_cache_hit or 0) - s.prompt_len),
                               min(first, s.request.arrival_time))
        for s, cached in looked:
            if (key := s.params.cache_key) is not None:
                aged = _aged_score(s, cached, step)
                best, first = groups.get(key, (aged, s.request.arrival_time))
                groups[key] = (max(best, aged), min(first, s.request.arrival_time))
        ahead = overdue_first(looked, step, self.config.max_wait_steps,
                              self.config.token_budget)
        scored = []
        for s, cached in looked:
            arrival = s.request.arrival_time
            if id(s) in ahead:      # overdue within the share: oldest first
                key: tuple = (0, *wait_order(s))
            else:
                aged, first = groups.get(s.params.cache_key,
                                         (_aged_score(s, cached, step), arrival))
                key = (1, -aged, first, arrival, s.index)
            scored.append((key, s, cached))
        scored.sort(key=lambda item: item[0])
        return [(s, cached) for _, s, cached in scored]

    def _shares_prefix_in_flight(self, seq: SeqState, cached: int | None) -> bool:
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

    def _add_span(self, plan: StepPlan, seq: SeqState, n: int) -> None:
        start = seq.num_computed
        batch = plan.batch
        samples = start + n == len(seq.token_ids)
        if n == 1:
            batch.input_ids.append(seq.token_ids[start])
            batch.positions.append(start)
        else:
            batch.input_ids.extend(seq.token_ids[start: start + n])
            batch.positions.extend(range(start, start + n))
        lease = seq.lease           # read directly: this runs for every span of every step
        batch.spans.append(SeqSpan(lease.pages, start, n))
        if lease.copy_orders:
            batch.copies.extend(lease.take_copy_orders())
        if samples:
            batch.sample_rows.append(len(batch.spans) - 1)
            batch.sample_params.append(seq.request.params)
            batch.generators.append(seq.generator)
            batch.matchers.append(seq.matcher)
        plan.seqs.append(seq)
        plan.new_lens.append(n)
        plan.samples.append(samples)

    # ---- after the forward pass ---------------------------------------------------

    def complete(self, plan: StepPlan, result: SampleResult) -> StepUpdate:
        """Advance every sequence of the step: count its computed tokens, insert computed
        pages into the tree, append sampled tokens. Aborted sequences are retired."""
        self.memory.moves_done()
        update = StepUpdate()
        sampled_seqs, sampled_tokens, sampled_logprobs = update.seqs, update.tokens, update.logprobs
        token_ids, logprobs = result.token_ids, result.logprobs
        running = SeqStatus.RUNNING
        row = 0
        for seq, n, samples in zip(plan.seqs, plan.new_lens, plan.samples):
            if seq.status is not running:
                row += samples
                continue        # preempted or retired meanwhile
            seq.num_computed += n
            if seq.request.aborted:
                row += samples
                self._retire(seq, keep=True)
                update.aborted.append(seq)
                continue
            if not samples:
                self.memory.commit(seq)     # insert after each prefill chunk
                continue
            if n > 1:
                self.memory.commit(seq)
            token = token_ids[row]
            seq.token_ids.append(token)
            seq.num_generated += 1
            if seq.matcher is not None:
                seq.matcher.accept(token)   # masked, so accepted; its mask next step
            sampled_seqs.append(seq)
            sampled_tokens.append(token)
            sampled_logprobs.append(logprobs[row])
            row += 1
        self.stats.steps += 1
        return update

    def finish(self, seqs: Iterable[SeqState]) -> None:
        """Retire sequences whose output ended (stop, length): their KV stays cached."""
        for seq in seqs:
            self._retire(seq, keep=True)

    def fail(self, plan: StepPlan) -> list[SeqState]:
        """A step raised: retire its sequences, freeing their (maybe half-written) pages."""
        self.memory.moves_done()
        return self._fail_sequences(plan.seqs)

    def fail_all(self) -> list[SeqState]:
        """The scheduler itself raised: retire every live sequence rather than hang them."""
        return self._fail_sequences(self.running + self.waiting)

    def _fail_sequences(self, seqs: list[SeqState]) -> list[SeqState]:
        failed = [seq for seq in seqs if seq.status is not SeqStatus.FINISHED]
        for seq in failed:
            self._retire(seq, keep=False)
        return failed

    # ---- retiring -----------------------------------------------------------------

    def _retire_aborted(self) -> list[SeqState]:
        if not any(r.aborted for r in self.requests.values()):
            return []
        aborted = [s for s in self.waiting + self.running if s.request.aborted]
        for seq in aborted:
            self._retire(seq, keep=True)
        return aborted

    def _retire(self, seq: SeqState, keep: bool) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.memory.retire(seq, keep=keep)
        seq.status = SeqStatus.FINISHED
        if seq.matcher is not None:
            seq.matcher.release()
        if seq.request.finished:
            self.requests.pop(seq.request.request_id, None)

    def _preempt(self, seq: SeqState) -> None:
        self.running.remove(seq)
        self.memory.release(seq, keep=True)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.insert(0, seq)
