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
from sched_harness import Bench, StepRecord, random_prompt

MAX_PROMPT = 96
MAX_NEW = 64

arrival = st.tuples(st.just("arrive"), st.integers(1, MAX_PROMPT), st.integers(1, MAX_NEW),
                    st.integers(1, 3), st.integers(0, 3))      # prompt, max_tokens, n, prefix
abort = st.tuples(st.just("abort"), st.integers(0, 1 << 16))
steps = st.tuples(st.just("step"), st.integers(1, 6))
operation = st.one_of(arrival, arrival, arrival, abort, steps)


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
    # Victims are the least advanced of what was running.
    kept = [s for s in record.running_before if s not in record.preempted]
    for victim in record.preempted:
        assert all(record.generated_before[victim] <= record.generated_before[s] for s in kept)
    # Aging: nothing admitted past a sequence that has waited longer than the bound.
    held = set(record.plan.deferred)
    for newcomer in record.admitted:
        for waiting in record.waiting_after:
            if waiting in held:
                continue
            lag = newcomer.request.arrival_step - waiting.request.arrival_step
            assert lag <= aging_bound, (
                f"{newcomer.request.request_id} (arrived step {newcomer.request.arrival_step}) "
                f"admitted before {waiting.request.request_id} "
                f"(arrived step {waiting.request.arrival_step})")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=60),
       page_size=st.sampled_from([1, 4, 16]),
       pool_tokens=st.integers(MAX_PROMPT + MAX_NEW + DECODE_RESERVE_TOKENS + 16, 320),
       budget=st.sampled_from([8, 32, 256]),
       max_running=st.integers(1, 16),
       policy=st.sampled_from(["lpm", "fcfs"]),
       seed=st.integers(0, 1000))
# Found by this test: a victim preempted and re-admitted in the same step recomputed a token
# it had already decoded (now no step that preempts admits anything).
@example(ops=[("arrive", 62, 32, 2, 0), ("arrive", 26, 31, 2, 0)], page_size=4, pool_tokens=209,
         budget=8, max_running=2, policy="lpm", seed=0)
def test_random_traffic_keeps_every_page_and_starves_no_one(ops, page_size, pool_tokens, budget,
                                                            max_running, policy, seed):
    # The engine caps the context so that one sequence always fits in the pool alone.
    num_pages = -(-pool_tokens // page_size)
    bench = Bench(page_size=page_size, num_pages=num_pages, max_running=max_running,
                  token_budget=budget, policy=policy, seed=seed)
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
