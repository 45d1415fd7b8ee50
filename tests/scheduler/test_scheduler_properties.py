"""Random arrivals, aborts and memory pressure against a null model (hypothesis).

After every step: page conservation (Bench.step), the running cap, the token budget, no
running decode left out, preemption victims the least advanced, and no waiting sequence
overtaken by one that arrived more than its aging bound later (unless it was held back for
a prefix in flight). Once arrivals stop, everything finishes and every sample gets exactly
one final event.
"""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from radixserve.engine.scheduler import AGING_TOKENS_PER_STEP, DECODE_RESERVE_TOKENS
from radixserve.engine.wait_bound import PREEMPT_AFTER_BOUNDS
from sched_harness import Bench, StepRecord, random_prompt

MAX_PROMPT = 96
MAX_NEW = 64

arrival = st.tuples(st.just("arrive"), st.integers(1, MAX_PROMPT), st.integers(1, MAX_NEW),
                    st.integers(1, 3), st.integers(0, 3))      # prompt, max_tokens, n, prefix
abort = st.tuples(st.just("abort"), st.integers(0, 1 << 16))
steps = st.tuples(st.just("step"), st.integers(1, 6))
operation = st.one_of(arrival, arrival, arrival, abort, steps)


def arrival(seq) -> tuple:
    """The wait bound's order (a victim preempted for an overdue request starts again)."""
    return (seq.waiting_since, seq.request.arrival_time, seq.index)


def oldest_overdue(sched, record: StepRecord):
    """The sequence the wait bound puts first in this step (lpm), if any."""
    if sched.config.policy != "lpm":
        return None
    overdue = [s for s in record.waiting_before
               if record.step - s.waiting_since >= sched.config.max_wait_steps]
    return min(overdue, key=arrival) if overdue else None


def check_step(bench: Bench, record: StepRecord, aging_bound: int) -> None:
    sched = bench.scheduler
    assert len(sched.running) <= bench.max_running
    # Prefill chunks stay within the budget; a decode always gets its one token.
    prefill = sum(n for s, n in zip(record.plan.seqs, record.plan.new_lens)
                  if record.remaining_before.get(s) != 1)
    assert prefill <= bench.token_budget
    for seq in record.running_before:
        if record.remaining_before[seq] == 1 and seq not in record.preempted \
                and not seq.request.aborted:
            assert record.new_lens(seq) == [1], "a running decode was left out"
    # Victims of a decode short of pages are the least advanced of what was running (and
    # nothing is admitted then); those preempted to admit the oldest overdue sequence
    # arrived after it.
    kept = [s for s in record.running_before if s not in record.preempted]
    head = oldest_overdue(sched, record)
    for victim in record.preempted:
        if record.plan.admission_stop == "preempted":
            assert all(record.generated_before[victim] <= record.generated_before[s]
                       for s in kept)
        else:
            assert head is not None and arrival(victim) > arrival(head)
    # The wait bound: the oldest overdue sequence is admitted, unless the step preempted a
    # decode, decodes took the whole budget, an overdue one admitted earlier still computes
    # its prompt (one is served at a time), or memory or the running cap keep it out while
    # it is overdue less than PREEMPT_AFTER_BOUNDS bounds or only older sequences run.
    if head is not None and head not in record.admitted and not head.request.aborted \
            and record.plan.admission_stop != "preempted":
        decodes = sum(1 for s in record.running_before if record.remaining_before[s] == 1)
        younger = [s for s in sched.running if arrival(s) > arrival(head)]
        serving = [s for s in record.running_before if record.remaining_before[s] > 1
                   and record.step - s.waiting_since >= sched.config.max_wait_steps]
        waited = record.step - head.waiting_since
        reserved = waited < PREEMPT_AFTER_BOUNDS * sched.config.max_wait_steps
        assert decodes >= bench.token_budget or serving or (
            (reserved or not younger)
            and record.plan.admission_stop in ("memory", "running cap")), (
            f"overdue {head.request.request_id} not admitted: "
            f"{record.plan.admission_stop or 'nothing stopped admission'}")
    # Aging: nothing admitted past a sequence that has waited longer than the bound.
    held = set(record.plan.deferred)
    for newcomer in record.admitted:
        for waiting in record.waiting_after:
            if waiting in held:
                continue
            lag = newcomer.waiting_since - waiting.waiting_since
            assert lag <= aging_bound, (
                f"{newcomer.request.request_id} (waiting since step {newcomer.waiting_since}) "
                f"admitted before {waiting.request.request_id} "
                f"(waiting since step {waiting.waiting_since})")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=60),
       page_size=st.sampled_from([1, 4, 16]),
       pool_tokens=st.integers(MAX_PROMPT + MAX_NEW + DECODE_RESERVE_TOKENS + 16, 320),
       budget=st.sampled_from([8, 32, 256]),
       max_running=st.integers(1, 16),
       policy=st.sampled_from(["lpm", "fcfs"]),
       seed=st.integers(0, 1000),
       max_wait=st.sampled_from([2, 16]))
# Found by this test: a victim preempted and re-admitted in the same step recomputed a token
# it had already decoded (now no step that preempts admits anything).
@example(ops=[("arrive", 62, 32, 2, 0), ("arrive", 26, 31, 2, 0)], page_size=4, pool_tokens=209,
         budget=8, max_running=2, policy="lpm", seed=0, max_wait=16)
def test_random_traffic_keeps_every_page_and_starves_no_one(ops, page_size, pool_tokens, budget,
                                                            max_running, policy, seed,
                                                            max_wait):
    # The engine caps the context so that one sequence always fits in the pool alone.
    num_pages = -(-pool_tokens // page_size)
    bench = Bench(page_size=page_size, num_pages=num_pages, max_running=max_running,
                  token_budget=budget, policy=policy, seed=seed)
    bench.scheduler.config.max_wait_steps = max_wait
    rng = random.Random(seed)
    prefixes = [random_prompt(rng, 48) for _ in range(3)]
    # A cached prefix is at most a sequence's whole length: so much age outweighs it.
    aging_bound = math.ceil((MAX_PROMPT + MAX_NEW) / AGING_TOKENS_PER_STEP)
    submitted = []

    def step():
        check_step(bench, bench.step(), aging_bound)

    for op in ops:
        if op[0] == "arrive":
            _, length, max_tokens, n, prefix = op
            head = prefixes[prefix - 1][:length - 1] if prefix else []
            prompt = head + random_prompt(rng, length - len(head))
            submitted.append(bench.submit(prompt, max_tokens=max_tokens, n=n,
                                          temperature=0.0))
        elif op[0] == "abort" and submitted:
            bench.abort(submitted[op[1] % len(submitted)].request_id)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()

    for record in bench.drain(max_steps=5000):      # arrivals stopped: everything drains
        check_step(bench, record, aging_bound)
    bench.check()
    stats = bench.scheduler.stats
    event(f"preempted: {stats.preemptions > 0}")
    event(f"deferred: {any(r.plan.deferred for r in bench.history)}")
    event(f"aborted: {stats.requests_finished.get('abort', 0) > 0}")
    overdue = [r for r in bench.history if oldest_overdue(bench.scheduler, r) is not None]
    event(f"a step with an overdue sequence: {bool(overdue)}")
    event(f"preempted to admit an overdue one: "
          f"{any(r.preempted and r.plan.admission_stop != 'preempted' for r in overdue)}")
    for request in submitted:
        outs = bench.outputs[request.request_id]
        finals = [o for o in outs if o.finished]
        assert sorted(o.index for o in finals) == list(range(request.params.n))
        for out in finals:
            tokens = sum(len(o.token_ids) for o in outs if o.index == out.index)
            assert tokens == out.usage.completion_tokens
            if out.finish_reason == "length":
                assert tokens == request.params.max_tokens
            else:
                assert out.finish_reason == "abort" and request.aborted
