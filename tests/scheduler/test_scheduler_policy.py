"""Each scheduling rule on its own, against a null model (no torch, milliseconds each).

lpm aging, the arrival-order fallback beyond LPM_QUEUE_LIMIT waiting, in-flight prefix
deferral, the admission decode reserve, preemption victim choice and chunk budgets. Every
step of every scenario also checks page conservation (sched_harness.Bench.step).
"""

from __future__ import annotations

import random

import pytest

from radixserve.engine.scheduler import (AGING_TOKENS_PER_STEP, DECODE_RESERVE_TOKENS,
                                         LPM_QUEUE_LIMIT)
from radixserve.engine.wait_bound import OVERDUE_BUDGET_SHARE, PREEMPT_AFTER_BOUNDS
from sched_harness import Bench, random_prompt

MARK = 1    # a token random_prompt never draws (it draws from 3 up)


def ids(seqs) -> list[str]:
    return [s.request.request_id for s in seqs]


def first_admitted(bench: Bench, candidates: set[str], max_steps: int = 200) -> str:
    for _ in range(max_steps):
        got = [r for r in ids(bench.step().admitted) if r in candidates]
        if got:
            return got[0]
    raise AssertionError(f"none of {candidates} was admitted")


def cache_prefix(bench: Bench, prefix: list[int]) -> None:
    """Run one request so that `prefix` (and a marker token) is in the tree."""
    bench.submit(prefix + [MARK], max_tokens=1)
    bench.run()


# ---- lpm and its aging ------------------------------------------------------------------

@pytest.mark.parametrize("delay, policy, winner", [
    (7, "lpm", "cached"),       # 256 fewer tokens to compute beat 7 steps of age (224)
    (9, "lpm", "old"),          # 9 steps of age (288 tokens) beat 256 fewer tokens
    (0, "fcfs", "old"),
])
def test_lpm_ages_waiting_requests(delay, policy, winner):
    assert AGING_TOKENS_PER_STEP * 7 < 256 < AGING_TOKENS_PER_STEP * 9
    rng = random.Random(1)
    bench = Bench(max_running=1, policy=policy)
    bench.scheduler.config.max_wait_steps = 10**9      # aging alone (the bound: below)
    shared = random_prompt(rng, 256)
    cache_prefix(bench, shared)
    blocker = bench.submit(random_prompt(rng, 8), max_tokens=30)   # holds the one slot
    bench.step()
    bench.submit(random_prompt(rng, 260), request_id="old", max_tokens=1)
    for _ in range(delay):
        bench.step()
    bench.submit(shared + random_prompt(rng, 4), request_id="cached", max_tokens=1)
    assert blocker.request_id in bench.scheduler.requests     # both still wait
    assert first_admitted(bench, {"old", "cached"}) == winner
    bench.run()
    assert bench.final("cached").usage.cached_tokens == 256


@pytest.mark.parametrize("waiting, winner", [
    (LPM_QUEUE_LIMIT, "cached"),        # at the limit: longest cached prefix first
    (LPM_QUEUE_LIMIT + 1, "oldest"),    # beyond it: arrival order
])
def test_lpm_falls_back_to_arrival_order_beyond_the_queue_limit(waiting, winner):
    rng = random.Random(2)
    bench = Bench(max_running=1)
    shared = random_prompt(rng, 64)
    cache_prefix(bench, shared)
    bench.submit(random_prompt(rng, 8), request_id="oldest", max_tokens=1)
    for _ in range(waiting - 2):
        bench.submit(random_prompt(rng, 8), max_tokens=1)
    bench.submit(shared + random_prompt(rng, 4), request_id="cached", max_tokens=1)
    assert len(bench.scheduler.waiting) == waiting
    assert ids(bench.step().admitted) == [winner]


# ---- prefixes another sequence is computing ----------------------------------------------

def test_a_request_waits_for_the_prefix_another_is_computing():
    rng = random.Random(3)
    bench = Bench(token_budget=512)
    shared = random_prompt(rng, 100)
    bench.submit(shared + random_prompt(rng, 10), request_id="a")
    bench.submit(shared + random_prompt(rng, 10), request_id="b")
    first = bench.step()
    assert ids(first.admitted) == ["a"] and ids(first.plan.deferred) == ["b"]
    second = bench.step()
    assert ids(second.admitted) == ["b"]
    bench.run()
    assert bench.final("a").usage.cached_tokens == 0
    assert bench.final("b").usage.cached_tokens == 100     # computed once, by a


def test_parallel_samples_wait_for_the_first_to_compute_the_prompt():
    rng = random.Random(4)
    bench = Bench(token_budget=512)
    prompt = random_prompt(rng, 50)
    bench.submit(prompt, n=3, request_id="p")
    assert bench.scheduler.num_waiting_requests == 1            # requests, not samples
    assert [s.index for s in bench.step().admitted] == [0]
    assert bench.scheduler.num_running_requests == bench.scheduler.num_waiting_requests == 1
    assert sorted(s.index for s in bench.step().admitted) == [1, 2]
    bench.run()
    assert [bench.final("p", i).usage.cached_tokens for i in range(3)] == [0, 49, 49]


@pytest.mark.parametrize("use_cache, shared_len", [(True, 0), (False, 100)])
def test_no_deferral_without_a_shared_prefix_or_without_the_cache(use_cache, shared_len):
    rng = random.Random(5)
    bench = Bench(token_budget=512, use_cache=use_cache)
    shared = random_prompt(rng, shared_len)
    bench.submit(shared + random_prompt(rng, 10), request_id="a")
    bench.submit(shared + random_prompt(rng, 10), request_id="b")
    assert ids(bench.step().admitted) == ["a", "b"]
    bench.run()


# ---- admission by memory ----------------------------------------------------------------

@pytest.mark.parametrize("over_by, admitted", [(0, True), (1, False)])
def test_admission_keeps_a_decode_reserve_for_running_sequences(over_by, admitted):
    # Page size 16: no look-ahead pages, and the running decode needs no new page soon.
    rng = random.Random(6)
    bench = Bench(page_size=16, num_pages=12)
    bench.submit(random_prompt(rng, 20), request_id="a", max_tokens=100)
    bench.step()
    available = bench.available_pages()
    reserve = DECODE_RESERVE_TOKENS // 16          # one page held back for a's decodes
    # b needs pages for its prompt plus its own decode reserve: that many pages.
    b_pages = available - reserve + over_by
    assert b_pages <= available                     # it would fit without a's reserve
    bench.submit(random_prompt(rng, b_pages * 16 - DECODE_RESERVE_TOKENS), request_id="b")
    step = bench.step()
    assert ("b" in ids(step.admitted)) is admitted
    assert step.plan.admission_stop == ("" if admitted else "memory")
    assert ids(step.plan.seqs).count("a") == 1      # a decodes either way
    bench.run()


def test_running_cap_limits_admission():
    rng = random.Random(7)
    bench = Bench(max_running=2)
    for _ in range(5):
        bench.submit(random_prompt(rng, 8), max_tokens=3)
    for _ in bench.drain():
        assert len(bench.scheduler.running) <= 2


# ---- preemption -------------------------------------------------------------------------

def test_preemption_takes_the_least_advanced_sequence():
    rng = random.Random(8)
    bench = Bench(page_size=16, num_pages=8)
    order = []
    for name in ("a", "b", "c"):
        bench.submit(random_prompt(rng, 16), request_id=name, max_tokens=60)
        order.append(name)
        for _ in range(3):
            bench.step()
    victims = []
    for record in bench.drain():
        for victim in record.preempted:
            victims.append(victim.request.request_id)
            others = [s for s in record.running_before if s not in record.preempted]
            assert all(record.generated_before[victim] <= record.generated_before[s]
                       for s in others)
    assert victims and victims[0] == "c"        # the youngest of three running
    assert bench.scheduler.stats.preemptions == len(victims)
    for name in order:                          # everyone finished its 60 tokens
        assert bench.final(name).finish_reason == "length"
        assert bench.final(name).usage.completion_tokens == 60


def test_a_preempted_sequence_recomputes_from_its_own_cached_pages():
    rng = random.Random(9)
    bench = Bench(page_size=16, num_pages=8)
    for name in ("a", "b", "c"):
        bench.submit(random_prompt(rng, 16), request_id=name, max_tokens=60)
        bench.step()
    bench.run()
    assert bench.scheduler.stats.preemptions > 0
    assert bench.scheduler.stats.recompute_hit_tokens > 0


# ---- chunked prefill --------------------------------------------------------------------

def test_a_long_prompt_is_computed_in_budget_sized_chunks():
    bench = Bench(token_budget=16)
    seq, = bench.submit(random_prompt(random.Random(10), 100), request_id="p").sequences
    chunks = [record.new_lens(seq)[0] for record in (bench.step() for _ in range(7))]
    assert chunks == [16] * 6 + [4]
    assert seq.num_generated == 1                  # sampled after the last chunk only


def test_decodes_share_the_step_budget_with_a_prefill():
    rng = random.Random(11)
    bench = Bench(token_budget=16)
    bench.submit(random_prompt(rng, 4), request_id="a", max_tokens=50)
    bench.step()
    seq, = bench.submit(random_prompt(rng, 40), request_id="b").sequences
    records = [bench.step() for _ in range(3)]
    assert [r.new_lens(seq)[0] for r in records] == [15, 15, 10]
    assert [r.num_tokens for r in records] == [16, 16, 11]     # b's chunk + a's decode
    # Decodes come after multi-token spans in the batch (the layout attention expects).
    assert all(r.plan.batch.spans[-1].new_len == 1 for r in records)


def test_decodes_run_even_when_the_budget_is_smaller_than_the_running_set():
    rng = random.Random(12)
    bench = Bench(token_budget=4)
    for _ in range(8):
        bench.submit(random_prompt(rng, 4), max_tokens=10)
    for record in bench.drain():
        decoding = [s for s in record.running_before if record.remaining_before[s] == 1]
        assert all(record.new_lens(s) == [1] for s in decoding)


def test_a_hit_whose_lock_blocks_its_own_admission_is_given_up():
    """Page size 4, a 17-page pool: b's copy-on-write hit locks all of a's edge (10
    pages), which leaves too few pages for b; with nothing running no page would ever
    come free. b must be admitted without the hit, not retried every step forever."""
    rng = random.Random(0)
    bench = Bench(page_size=4, num_pages=17)
    a = random_prompt(rng, 40)
    bench.submit(a, max_tokens=1, request_id="a")
    bench.run(max_steps=50)
    b = a[:30] + random_prompt(rng, 14)
    bench.submit(b, max_tokens=2, request_id="b")
    bench.run(max_steps=50)
    final = bench.final("b")
    assert final.finished and final.usage.completion_tokens == 2
    assert final.usage.cached_tokens == 0


@pytest.mark.parametrize("cap", [4, 16])
def test_lpm_admits_a_cold_request_within_its_wait_bound(cap):
    """A stream of hot requests (1,024 cached tokens each: 32 steps of aging) keeps arriving
    while one slot serves them; the cold one is admitted within `max_wait_steps` steps of
    its arrival plus the running request's end, and never before an older hot one."""
    rng = random.Random(3)
    bench = Bench(max_running=1)
    bench.scheduler.config.max_wait_steps = cap
    shared = random_prompt(rng, 1024)
    cache_prefix(bench, shared)
    bench.submit(shared + random_prompt(rng, 4), max_tokens=3)
    bench.step()
    arrival = bench.scheduler.step
    bench.submit(random_prompt(rng, 16), request_id="cold", max_tokens=1)
    admitted_at = None
    for i in range(200):
        bench.submit(shared + random_prompt(rng, 4), request_id=f"hot{i}", max_tokens=1)
        record = bench.step()
        if "cold" in ids(record.admitted):
            admitted_at = record.step
            break
    assert admitted_at is not None and admitted_at - arrival <= cap + 3
    assert admitted_at - arrival >= min(cap, 3)      # hot ones did go first while not overdue
    bench.run()


def test_lpm_puts_only_a_budget_share_of_overdue_requests_first():
    """Six cold requests become overdue together behind a blocker: only the oldest ones
    whose prefill fits in OVERDUE_BUDGET_SHARE of the token budget go first (at least
    one); a hot request arriving later then goes before the remaining overdue ones, so a
    burst of overdue requests does not turn lpm into arrival order. Every step, the oldest
    overdue request heads the order (the guarantee)."""
    rng = random.Random(5)
    cap, cold_len = 4, 300
    bench = Bench(max_running=1, token_budget=2048)
    bench.scheduler.config.max_wait_steps = cap
    shared = random_prompt(rng, 512)
    cache_prefix(bench, shared)
    bench.submit(random_prompt(rng, 8), request_id="blocker", max_tokens=cap + 8)
    bench.step()
    for i in range(6):
        bench.submit(random_prompt(rng, cold_len), request_id=f"cold{i}", max_tokens=1)
    for _ in range(cap):
        bench.step()
    bench.submit(shared + random_prompt(rng, 4), request_id="hot", max_tokens=1)
    order = [s.request.request_id for s, _ in bench.scheduler._ordered_waiting()]
    # a 512-token share: cold0 (300) leaves 212, so cold1 starts within it too
    assert OVERDUE_BUDGET_SHARE * bench.scheduler.config.token_budget == 512
    first = 2
    assert order[:first] == [f"cold{i}" for i in range(first)]
    assert order[first] == "hot"
    assert order[first + 1:] == [f"cold{i}" for i in range(first, 6)]
    admitted = []
    while len(admitted) < 6:
        waiting = [s.request.request_id for s, _ in bench.scheduler._ordered_waiting()]
        colds = [r for r in waiting if r.startswith("cold")]    # all overdue by now
        assert waiting[0] == min(colds, key=lambda r: int(r[4:]))
        admitted += [r for r in ids(bench.step().admitted) if r.startswith("cold")]
    assert admitted == [f"cold{i}" for i in range(6)]     # overdue ones stay oldest first
    bench.run()


def test_lpm_prefers_less_prefill_work():
    """Two cold prompts arrive in one step: the shorter one (less to compute) goes first;
    with equal lengths the longer cached prefix does (the classic lpm order)."""
    rng = random.Random(6)
    bench = Bench(max_running=1)
    bench.submit(random_prompt(rng, 8), request_id="blocker", max_tokens=3)
    bench.step()
    bench.submit(random_prompt(rng, 900), request_id="long", max_tokens=1)
    bench.submit(random_prompt(rng, 100), request_id="short", max_tokens=1)
    assert first_admitted(bench, {"long", "short"}) == "short"
    bench.run()


def test_without_the_bound_lpm_makes_the_cold_request_wait_for_aging():
    rng = random.Random(3)
    bench = Bench(max_running=1)
    bench.scheduler.config.max_wait_steps = 10**9
    shared = random_prompt(rng, 1024)
    cache_prefix(bench, shared)
    bench.submit(random_prompt(rng, 1028), request_id="cold", max_tokens=1)
    arrival = bench.scheduler.step
    for i in range(200):
        bench.submit(shared + random_prompt(rng, 4), request_id=f"hot{i}", max_tokens=1)
        if "cold" in ids(bench.step().admitted):
            break
    assert bench.scheduler.step - arrival >= 1024 // AGING_TOKENS_PER_STEP
    bench.run()


@pytest.mark.parametrize("key, order", [("conv-a", ["r1", "r2", "r3"]),
                                        (None, ["r1", "r3", "r2"])])
def test_lpm_admits_a_prompt_cache_key_group_together(key, order):
    """r2 shares r1's prompt_cache_key but not its cached prefix: it takes r1's score and is
    admitted right after it, before r3 (whose own score beats r2's); without the key, r3
    goes first."""
    rng = random.Random(4)
    bench = Bench(max_running=8)
    long_prefix, short_prefix = random_prompt(rng, 256), random_prompt(rng, 128)
    cache_prefix(bench, long_prefix)
    cache_prefix(bench, short_prefix)
    bench.submit(long_prefix + random_prompt(rng, 4), request_id="r1", max_tokens=1,
                 cache_key=key)
    bench.submit(random_prompt(rng, 40), request_id="r2", max_tokens=1, cache_key=key)
    bench.submit(short_prefix + random_prompt(rng, 4), request_id="r3", max_tokens=1)
    assert ids(bench.step().plan.seqs) == order       # admitted in this order, in one step
    bench.run()


@pytest.mark.parametrize("held_by", ["running cap", "memory"])
@pytest.mark.parametrize("cap", [8, None])
def test_a_stream_of_hits_cannot_delay_a_cold_request_past_its_bound(held_by, cap):
    """Hits (1,024 cached tokens, 40 to generate) arrive with a cold 512-token prompt, then
    one a step, and are admitted ahead of it until the running cap, or memory, is full.
    With the bound, the cold one goes first from `cap` steps after its arrival (nothing
    else is admitted: what frees up is kept for it), and PREEMPT_AFTER_BOUNDS x `cap` steps
    after its arrival the youngest hits are preempted to make room (their KV stays cached;
    they finish later with all their tokens). Without the bound (aging only), the cold one
    waits for running hits to finish."""
    rng = random.Random(21)
    # (the bench, hits arriving with the cold one)
    sizes, burst = {"running cap": (dict(max_running=3), 3),
                    "memory": (dict(max_running=64, num_pages=1024 + 512 + 16 * 8 + 200), 16),
                    }[held_by]
    bench = Bench(**sizes)
    bench.scheduler.config.max_wait_steps = cap or 10**9
    shared = random_prompt(rng, 1024)
    cache_prefix(bench, shared)
    arrival = bench.scheduler.step
    cold = bench.submit(random_prompt(rng, 512), request_id="cold", max_tokens=1)
    admitted_at, hot, stops = None, [], set()
    for i in range(PREEMPT_AFTER_BOUNDS * 8 + 8):
        for j in range(burst if i == 0 else 1):
            hot.append(bench.submit(shared + random_prompt(rng, 4), request_id=f"hot{i}.{j}",
                                    max_tokens=40))
        record = bench.step()
        stops.add(record.plan.admission_stop)
        if cap and record.step - arrival >= cap:      # overdue: admission waits behind it
            assert ids(record.admitted) in ([], ["cold"])
        if "cold" in ids(record.admitted):
            admitted_at = record.step
            victims = record.preempted
            break
    if cap is None:
        assert admitted_at is None and held_by in stops   # still waiting
    else:
        assert admitted_at == arrival + PREEMPT_AFTER_BOUNDS * cap
        assert held_by in stops                 # the hits did fill the slots / the memory
        assert victims and all(v.request.arrival_time > cold.arrival_time for v in victims)
    bench.run()
    assert bench.final("cold").usage.completion_tokens == 1
    for request in hot:                         # the preempted hits lost no token
        assert bench.final(request.request_id).usage.completion_tokens == 40


def test_an_overdue_request_gets_its_budget_share_beside_a_long_prefill():
    """A 1,000-token prompt takes the whole 64-token budget every step. A 40-token prompt
    arriving behind it is admitted when it becomes overdue, with the share of the budget
    the long prefill then leaves (16 tokens), and keeps that share until its prompt is
    done: its first token comes in the third step from its bound, not after the long prompt."""
    rng = random.Random(22)
    cap, budget = 4, 64
    share = int(OVERDUE_BUDGET_SHARE * budget)
    bench = Bench(token_budget=budget)
    bench.scheduler.config.max_wait_steps = cap
    long, = bench.submit(random_prompt(rng, 1000), request_id="long", max_tokens=1).sequences
    bench.step()
    arrival = bench.scheduler.step
    cold, = bench.submit(random_prompt(rng, 40), request_id="cold", max_tokens=1).sequences
    records = [bench.step() for _ in range(cap + 2)]
    assert all(r.new_lens(cold) == [] and r.plan.admission_stop == "budget"
               for r in records[:cap - 1])
    assert [r.new_lens(cold) for r in records[cap - 1:]] == [[share], [share], [8]]
    assert [r.new_lens(long)[0] for r in records[cap - 1:]] == [
        budget - share, budget - share, budget - 8]
    assert records[cap - 1].step == arrival + cap
    assert bench.finished("cold") and not bench.finished("long")
    bench.run()
