"""Token mode (real token ids in the tree) and block mode (one symbol per page) agree.

On a slice of the shared trace, under eviction, for several page sizes, policies and
concurrency levels: the same hit tokens, hit requests and misses. Plus the ceiling of the
first 500 requests against a direct computation from the hash ids.
"""

from __future__ import annotations

import math

import pytest

from radixserve.replay.replayer import ReplayConfig, replay
from radixserve.replay.traces import read_trace
from radixserve.replay.workload import Workload


@pytest.fixture(scope="module")
def slice300(request):
    from .helpers import REAL_TRACE

    return read_trace(REAL_TRACE, limit=300)


CASES = [  # (page size, capacity tokens, policy, concurrency)
    (512, 300_000, "lru", 1), (512, 300_000, "lfu", 4), (512, 300_000, "gdsf", 1),
    (512, 150_000, "belady", 1), (512, 1_000_000, "lru", 4), (512, 150_000, "belady", 4),
    (128, 300_000, "lru", 1), (128, 1_000_000, "gdsf", 4), (128, 150_000, "belady", 1),
    (64, 700_000, "lru", 1),
]


@pytest.mark.parametrize("page_size,capacity,policy,concurrency", CASES)
def test_token_mode_equals_block_mode(slice300, page_size, capacity, policy, concurrency):
    config = ReplayConfig(capacity, policy, concurrency, check_every=100)
    block = replay(Workload(slice300, "block", page_size), config)
    token = replay(Workload(slice300, "token", page_size), config)
    assert (block.hit_tokens, block.hit_requests, block.unfit_requests) == \
        (token.hit_tokens, token.hit_requests, token.unfit_requests)
    ceiling = replay(Workload(slice300, "block", page_size), ReplayConfig(None))
    assert 0 < block.hit_tokens < ceiling.hit_tokens   # eviction did cost hits


def reference_ceiling(requests, bs):
    """Unbounded cache, page = block: hits are the leading blocks some earlier prompt held
    whole (the partial last block of a prompt is never cached), capped at L-1 tokens."""
    seen: set[int] = set()
    hit_tokens = hit_requests = 0
    for r in requests:
        L = r.input_length
        matchable = r.hash_ids[: math.ceil((L - 1) / bs)]
        m = 0
        while m < len(matchable) and matchable[m] in seen:
            m += 1
        hit = min(m * bs, L - 1)
        hit_tokens += hit
        hit_requests += hit > 0
        seen.update(r.hash_ids[: L // bs])
    return hit_tokens, hit_requests


def test_ceiling_of_first_500_requests(real_trace, capsys):
    trace = read_trace(real_trace, limit=500)
    want = reference_ceiling(trace.requests, 512)
    for mode in ("block", "token"):
        got = replay(Workload(trace, mode, 512), ReplayConfig(None))
        assert (got.hit_tokens, got.hit_requests) == want
        assert got.unfit_requests == 0
    with capsys.disabled():
        print(f"\nceiling of the first 500 requests: {got.token_hit_rate:.2%} of "
              f"{got.query_tokens:,} prompt tokens, {got.request_hit_rate:.2%} of requests")


def test_belady_is_the_upper_bound_on_a_slice(slice300):
    work = Workload(slice300, "block", 512)
    for capacity in (200_000, 500_000, 1_500_000):
        opt = replay(work, ReplayConfig(capacity, "belady")).hit_tokens
        for policy in ("lru", "lfu", "gdsf"):
            assert replay(work, ReplayConfig(capacity, policy)).hit_tokens <= opt, policy


def test_token_mode_equals_block_mode_with_outputs(slice300):
    # Cached outputs: the modes agree as long as no page straddles prompt and output (a
    # straddling page can be copied-on-write in token mode only; see docs/replay.md), so
    # make every prompt end on a page boundary.
    import dataclasses

    whole = dataclasses.replace(slice300, requests=[
        dataclasses.replace(r, input_length=len(r.hash_ids) * 512, output_length=700)
        for r in slice300.requests])
    for capacity, policy in ((400_000, "lru"), (400_000, "belady"), (None, "lru")):
        config = ReplayConfig(capacity, policy, 2, check_every=100)
        block = replay(Workload(whole, "block", 256, include_outputs=True), config)
        token = replay(Workload(whole, "token", 256, include_outputs=True), config)
        assert (block.hit_tokens, block.unfit_requests) == \
            (token.hit_tokens, token.unfit_requests)
        assert block.hit_tokens > 0
