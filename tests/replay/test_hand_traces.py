"""Tiny traces whose hit rates are worked out by hand (block size = page size = 4 tokens).

A prompt of L tokens can hit at most L-1 of them: the last prompt token is always computed.
"""

from __future__ import annotations

import pytest

from .helpers import hash_record as rec
from .helpers import replay_records, write_jsonl

from radixserve.replay.tokens import TextTokenizer

# Traces of input_ids / output_ids never load a tokenizer; this one would fail if asked.
NO_TOKENIZER = TextTokenizer("no-such-model")

MODES = ["block", "token"]


@pytest.mark.parametrize("mode", MODES)
def test_unbounded_prefix_sharing(tmp_path, mode):
    records = [
        rec([1, 2, 3], 12),   # nothing cached: 0
        rec([1, 2, 4], 12),   # blocks 1, 2 cached: 8
        rec([1, 2, 3], 10),   # 1, 2 cached, block 3 (2 tokens, 1 matchable) copied: 9
        rec([5], 3),          # new: 0
        rec([5], 3),          # block 5 was partial (3 tokens), never inserted: 0
        rec([1, 2, 4, 6], 13),  # 1, 2, 4 full-cached (12 tokens = L-1): 12
    ]
    s = replay_records(tmp_path, records, None, mode=mode)
    assert s.query_tokens == 12 + 12 + 10 + 3 + 3 + 13
    assert s.hit_tokens == 0 + 8 + 9 + 0 + 0 + 12
    assert s.hit_requests == 3
    assert s.token_hit_rate == pytest.approx(29 / 53)
    assert s.request_hit_rate == pytest.approx(3 / 6)
    assert s.unfit_requests == 0


@pytest.mark.parametrize("mode", MODES)
def test_lru_eviction_under_small_capacity(tmp_path, mode):
    # 3 pages of 4 tokens. Every prompt is 2 full blocks (8 tokens, 7 matchable).
    records = [
        rec([1, 2], 8),  # miss; tree {1-2}, 1 page free
        rec([3, 4], 8),  # miss; needs 2: evicts the LRU leaf's tail (page 2); tree {1},{3-4}
        rec([1, 2], 8),  # hits page 1 (4 tokens); page 2 gone; evicts 4; tree {1-2},{3}
        rec([3, 4], 8),  # hits page 3 (4); evicts 2 (the only unlocked leaf); tree {1},{3-4}
        rec([1, 2], 8),  # hits page 1 (4); evicts 4
    ]
    s = replay_records(tmp_path, records, 12, "lru", mode=mode)
    assert s.num_pages == 3
    assert s.hit_tokens == 0 + 0 + 4 + 4 + 4
    assert s.hit_requests == 3
    # 4 pages hold both prompts, but a repeat that hits 7 tokens copies the 3 matched
    # tokens of its second page into a fresh page (copy-on-write), so it needs a third
    # page: request 2 hits 7 and evicts page 4 (LRU tail); request 3 hits page 3 only (4)
    # and re-inserts 4 into the free page; request 4 hits 7 again.
    s = replay_records(tmp_path, records, 16, "lru", mode=mode)
    assert s.hit_tokens == 0 + 0 + 7 + 4 + 7
    # 5 pages: room for both prompts and the copy; every repeat hits all 7.
    s = replay_records(tmp_path, records, 20, "lru", mode=mode)
    assert s.hit_tokens == 0 + 0 + 7 + 7 + 7


CYCLE = [rec([b, 100 + i], 5) for i, b in enumerate([1, 2, 3] * 3)]
# Each request: one full block (4 tokens, all matchable) and a 1-token private tail.
# With 3 pages a miss needs 2, so the tree keeps 2 blocks: a cache of 2 entries on a
# cycle of 3. LRU always evicts the one needed next (0 hits); Belady evicts the block
# used farthest ahead and hits requests 3, 5 and 7 (4 tokens each).


@pytest.mark.parametrize("mode", MODES)
def test_belady_beats_lru_on_a_cycle(tmp_path, mode):
    lru = replay_records(tmp_path, CYCLE, 12, "lru", mode=mode)
    opt = replay_records(tmp_path, CYCLE, 12, "belady", mode=mode)
    assert lru.hit_tokens == 0
    assert opt.hit_tokens == 12
    assert opt.hit_requests == 3
    assert opt.token_hit_rate == pytest.approx(12 / 45)


def test_too_small_for_one_request_counts_a_miss(tmp_path):
    records = [rec([1, 2, 3], 12), rec([1], 4), rec([1, 2, 3], 12), rec([1], 4)]
    # 2 pages: the 3-page prompts never fit; the 1-block ones do but find nothing cached
    # (block 1 of a 4-token prompt is inserted, so the second one hits 3 tokens).
    s = replay_records(tmp_path, records, 8, "lru")
    assert s.unfit_requests == 2
    assert s.hit_tokens == 3
    assert s.measured_requests == 4
    s = replay_records(tmp_path, records, 0, "lru")   # no pages at all: all misses
    assert (s.unfit_requests, s.hit_tokens) == (4, 0)


def test_warmup_fraction_excludes_leading_requests(tmp_path):
    records = [rec([1, 2], 8), rec([1, 2], 8), rec([1, 2], 8), rec([9], 4)]
    s = replay_records(tmp_path, records, None, warmup_fraction=0.5)
    assert s.measured_requests == 2
    assert s.query_tokens == 8 + 4
    assert s.hit_tokens == 7
    assert s.requests == 4


@pytest.mark.parametrize("mode", MODES)
def test_concurrency_delays_output_insertion(tmp_path, mode):
    # A two-turn chat as a text trace of token ids (page size 1): turn 2's prompt is turn 1's
    # prompt + its recorded output + a new question. An output enters the cache when its
    # request completes; with concurrency 2, turn 1 is still in flight when turn 2 arrives
    # (only its prompt, inserted after prefill, can be hit).
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.traces import read_trace
    from radixserve.replay.workload import Workload

    turn1 = {"input_ids": list(range(1, 9)), "output_ids": [9, 10, 11, 12]}
    turn2 = {"input_ids": list(range(1, 17)), "output_length": 2}
    trace = read_trace(write_jsonl(tmp_path / "chat.jsonl", [turn1, turn2]), "text")
    workload = Workload(trace, mode, 1, include_outputs=True, tokenizer=NO_TOKENIZER)
    hits = {c: replay(workload, ReplayConfig(None, "lru", c, check_every=1)).hit_tokens
            for c in (1, 2)}
    assert hits == {1: 12, 2: 8}
    # Without outputs in the cache only the shared prompt can hit, whatever the concurrency.
    workload = Workload(trace, mode, 1, include_outputs=False, tokenizer=NO_TOKENIZER)
    assert replay(workload, ReplayConfig(None, "lru", 1)).hit_tokens == 8


@pytest.mark.parametrize("mode", MODES)
def test_outputs_take_pages(tmp_path, mode):
    # Prompt [1,2] (2 pages) with a 4-token output (1 more page), twice, around a 1-page
    # request. The repeat hits 7 tokens: page 1 and a copy-on-write of page 2, which needs a
    # fresh page; with its output it needs 2 fresh pages while 2 tree pages stay locked.
    records = [rec([1, 2], 8, output_length=4), rec([7], 4), rec([1, 2], 8, output_length=4)]
    # 3 pages, prompts only: request 1 takes the free page, request 2 evicts [7]: hits 7.
    assert replay_records(tmp_path, records, 12, "lru", mode=mode).hit_tokens == 7
    # 3 pages with outputs: request 0 leaves {1-2}{out}; request 1 evicts the output page;
    # request 2 needs 4 pages in all: it cannot fit and counts as a miss.
    outs = replay_records(tmp_path, records, 12, "lru", mode=mode, include_outputs=True)
    assert (outs.hit_tokens, outs.unfit_requests) == (0, 1)
    # 4 pages with outputs: request 2 evicts the output page and [7] (LRU order) and hits 7.
    outs = replay_records(tmp_path, records, 16, "lru", mode=mode, include_outputs=True)
    assert (outs.hit_tokens, outs.unfit_requests) == (7, 0)
    # 2 pages: neither 3-page request fits.
    tight = replay_records(tmp_path, records, 8, "lru", mode=mode, include_outputs=True)
    assert (tight.unfit_requests, tight.hit_tokens) == (2, 0)
