"""The dead-first offline bound: LRU, except that pages no later request uses go first."""

from __future__ import annotations

import random

import pytest

from radixserve.replay.cluster import ClusterConfig

from .helpers import hash_record as rec
from .helpers import replay_records

BS = 4  # tokens per block = per page


def test_a_dead_leaf_goes_before_an_older_live_one(tmp_path):
    """Capacity 4 pages. [1,2] is used again, [5,6] and [7,8] never: when [7,8] needs room,
    LRU evicts the older [1,2] and the last request misses; dead-first evicts [5,6] and
    the last request hits all but its last token (at most L-1 tokens match: page 1 whole,
    page 2 by copy-on-write)."""
    records = [rec([1, 2], 2 * BS), rec([5, 6], 2 * BS), rec([7, 8], 2 * BS),
               rec([1, 2], 2 * BS)]
    lru = replay_records(tmp_path, records, 4 * BS, "lru")
    dead = replay_records(tmp_path, records, 4 * BS, "dead-first")
    best = replay_records(tmp_path, records, 4 * BS, "belady")
    assert (lru.hit_tokens, dead.hit_tokens, best.hit_tokens) == (0, 2 * BS - 1, 2 * BS - 1)


@pytest.mark.parametrize("seed", range(4))
def test_between_lru_and_the_optimum_on_random_sessions(tmp_path, seed):
    """Random conversations (each turn extends its history by 1-3 blocks, some end at once):
    dead-first never beats the exact optimum; pages and locks are checked after every
    request (replay_records runs the checks)."""
    rng = random.Random(seed)
    histories, records, next_block = [], [], 1
    for _ in range(60):
        if not histories or rng.random() < 0.3:
            histories.append([])
        h = rng.choice(histories)
        h += range(next_block, next_block + rng.randint(1, 3))
        next_block += 3
        records.append(rec(list(h), len(h) * BS))
        if rng.random() < 0.2:
            histories.remove(h)
    for cap in (6 * BS, 12 * BS, 24 * BS):
        dead = replay_records(tmp_path, records, cap, "dead-first")
        best = replay_records(tmp_path, records, cap, "belady")
        assert dead.hit_tokens <= best.hit_tokens


def test_refused_in_a_cluster():
    with pytest.raises(ValueError, match="offline policy 'dead-first'"):
        ClusterConfig(4, "pow2", 100, "dead-first")
