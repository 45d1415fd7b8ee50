"""The adaptive eviction policy: registration, stable keys, learning, ghosts, admission,
bounded state, and that it beats LRU where reuse odds differ by class."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

from radixserve.cache import PagedMemory, RadixCache, make_policy
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.adaptive_policy import CLASS_NAMES, AdaptivePolicy

REPO = Path(__file__).parents[2]
REAL_TRACE = REPO.parent / "shared" / "traces" / "mooncake_fast25_synthetic_trace.jsonl"
NO_EXPLORERS = 1 << 40          # (id * odd constant) % this is never 0 for small ids
TWICE, OFTEN = CLASS_NAMES[:2]
ROOT, BRANCH = "new at root", "new under a prefix"     # + the size bucket


def _cache(policy: AdaptivePolicy, num_pages: int = 64) -> tuple[RadixCache, PagedMemory]:
    tree = RadixCache(1, policy)
    return tree, PagedMemory(num_pages, tree)


def _request(tree: RadixCache, mem: PagedMemory, tokens: list[int]) -> int:
    """What the engine does with one prompt; returns the matched tokens."""
    lease = PrefixLease(mem)
    lease.acquire(tokens, max_tokens=len(tokens) - 1)
    matched = lease.matched_tokens
    lease.grow(len(tokens) - len(lease.pages))
    lease.release(tokens, len(tokens))
    return matched


def _leaf(tree: RadixCache, last_token: int):
    return next(n for n in tree.iter_nodes() if n.tokens[-1] == last_token)


def test_registered_for_replay_and_serve():
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)
    from radixserve.engine.config import EngineConfig, add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--eviction-policy", "adaptive"])
    assert EngineConfig.from_args(args).eviction_policy == "adaptive"
    from radixserve.replay.sweep import check_policies

    check_policies(["lru", "adaptive"])


def test_bad_parameters_are_refused():
    for kwargs in ({"window": 1}, {"explore": 0}, {"admission_threshold": 1.0},
                   {"ghost_factor": -1}):
        with pytest.raises(ValueError):
            AdaptivePolicy(**kwargs)


def test_key_is_stable_until_the_node_changes():
    policy = AdaptivePolicy(explore=NO_EXPLORERS)
    tree, mem = _cache(policy)
    _request(tree, mem, [1, 2, 3, 4])
    leaf = _leaf(tree, 4)
    first = policy.key(leaf)
    policy.trials[0] += 50.0                      # learning moves on ...
    assert policy.key(leaf) == first              # ... a recomputation does not
    tree.check_invariants()
    _request(tree, mem, [1, 2, 3, 4])             # a hit re-keys it
    assert leaf.evict_key[0] != first
    tree.check_invariants()


def test_classes_from_tree_shape_hits_and_ghosts():
    policy = AdaptivePolicy(explore=NO_EXPLORERS)
    tree, mem = _cache(policy, num_pages=16)
    _request(tree, mem, [1, 2, 3])
    assert policy.class_of(_leaf(tree, 3)) == "new at root, < 4 tokens"
    _request(tree, mem, [1, 2, 3, 7, 8, 9, 10, 11])     # a next turn: under a cached prefix
    assert policy.class_of(_leaf(tree, 11)) == "new under a prefix, < 16 tokens"
    _request(tree, mem, [1, 2, 3, 7, 8, 9, 10, 11, 12])  # hits the turn: used twice
    assert policy.class_of(_leaf(tree, 12)) == "new under a prefix, < 4 tokens"
    mem.free(tree.evict(1))                       # the newest turn goes ...
    assert policy.class_of(_leaf(tree, 11)) == TWICE
    mem.free(tree.evict(tree.total_tokens))      # ... then everything
    assert tree.total_tokens == 0
    _request(tree, mem, [1, 2, 3, 7, 8, 9, 10, 11])   # the ghost table remembers its end
    assert policy.class_of(_leaf(tree, 11)) == OFTEN
    tree.check_invariants()


def _learned(policy: AdaptivePolicy, prefix: str, odds: float, trials: float = 200.0):
    """Pretend the policy learned these odds for every class whose name starts so."""
    for c, name in enumerate(CLASS_NAMES):
        if name.startswith(prefix):
            policy.trials[c] = trials
            policy.successes[c] = odds * trials


def test_admission_evicts_a_tail_with_no_reuse_signal_first():
    """Learned: tails under a prefix are never reused, root-level content often is."""
    for admission, first_out in ((True, 24), (False, 13)):
        policy = AdaptivePolicy(explore=NO_EXPLORERS, admission=admission)
        _learned(policy, ROOT, 0.6)          # (no leaf here is old enough to be withdrawn)
        _learned(policy, BRANCH, 0.01)
        tree, mem = _cache(policy, num_pages=64)
        _request(tree, mem, [10, 11, 12, 13])                 # old, root-level
        for _ in range(30):                                    # time passes
            tree.match_prefix([99])
        _request(tree, mem, [20, 21, 22, 23])                  # a shared prefix ...
        _request(tree, mem, [20, 21, 22, 23, 24])              # ... and a unique tail
        gone = tree.evict(1)
        assert len(gone) == 1
        assert first_out not in {n.tokens[-1] for n in tree.iter_nodes()}, admission
        tree.check_invariants()


def test_reused_content_is_never_evicted_before_lru_would():
    policy = AdaptivePolicy(explore=NO_EXPLORERS, admission=False)
    _learned(policy, TWICE, 0.01)                  # even with poor odds for its class
    tree, mem = _cache(policy)
    _request(tree, mem, [1, 2, 3])
    _request(tree, mem, [1, 2, 3, 4])              # used twice: its bonus is >= 0
    mem.free(tree.evict(1))                        # [4] goes, [1, 2, 3] is a leaf again
    leaf = _leaf(tree, 3)
    assert policy.class_of(leaf) == TWICE
    assert leaf.evict_key[0] >= leaf.last_access


def test_explorers_are_keyed_class_blind_and_teach_the_odds():
    policy = AdaptivePolicy(explore=1, admission=True)   # every leaf an explorer
    _learned(policy, BRANCH, 0.0)
    tree, mem = _cache(policy)
    _request(tree, mem, [1, 2, 3])
    _request(tree, mem, [1, 2, 3, 4, 5])
    leaf = _leaf(tree, 5)
    assert leaf.evict_key[0] > -1e6              # no admission penalty for an explorer
    c = CLASS_NAMES.index(policy.class_of(leaf))
    assert CLASS_NAMES[c].startswith(BRANCH)
    _request(tree, mem, [1, 2, 3, 4, 5, 6])      # its hit is a success of its class
    assert policy.successes[c] > 0.99            # (decayed by later trials)
    assert policy.horizon > 0


def test_state_stays_bounded():
    """Memo and ghost table do not grow with the number of requests, only with the tree."""
    policy = AdaptivePolicy()
    tree, mem = _cache(policy, num_pages=32)
    rng = np.random.default_rng(0)
    for i in range(20_000):
        _request(tree, mem, [int(rng.integers(4)), *rng.integers(10, 10**6, 5).tolist()])
    assert len(policy._memo) <= 2 * 32 + 4096 + 1
    assert len(policy._ghost) <= policy.ghost_factor * max(len(policy._memo), 1024)
    tree.check_invariants()
    mem.check_conservation()


@pytest.mark.parametrize("page_size", [512, 128])
def test_token_mode_equals_block_mode(page_size):
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.traces import read_trace
    from radixserve.replay.workload import Workload

    trace = read_trace(REAL_TRACE, limit=300)
    config = ReplayConfig(300_000, "adaptive", 2, check_every=50)
    block = replay(Workload(trace, "block", page_size), config)
    token = replay(Workload(trace, "token", page_size), config)
    assert (block.hit_tokens, block.hit_requests) == (token.hit_tokens, token.hit_requests)


def test_beats_lru_on_rag_traffic(tmp_path, load_script):
    """Popular documents vs unique questions: the questions' class is learned to be dead."""
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.traces import read_trace
    from radixserve.replay.workload import Workload

    gen = load_script("gen_traces")
    assert gen.main(["--out", str(tmp_path), "--workloads", "rag", "--requests", "1500"]) == 0
    work = Workload(read_trace(str(tmp_path / "rag.jsonl"), block_size=16), "block", 16)
    lru = replay(work, ReplayConfig(250_000, "lru"))
    adaptive = replay(work, ReplayConfig(250_000, "adaptive", check_every=500))
    assert adaptive.hit_tokens > lru.hit_tokens * 1.03, (adaptive.hit_tokens, lru.hit_tokens)


def test_generated_traces_are_deterministic_and_valid(tmp_path, load_script):
    from radixserve.replay.traces import read_trace

    gen = load_script("gen_traces")
    for out in (tmp_path / "a", tmp_path / "b"):
        assert gen.main(["--out", str(out), "--requests", "200", "--seed", "3"]) == 0
    for name in ("chat", "agent", "fewshot", "rag", "mixed"):
        a = (tmp_path / "a" / f"{name}.jsonl").read_bytes()
        assert a == (tmp_path / "b" / f"{name}.jsonl").read_bytes(), name
        trace = read_trace(str(tmp_path / "a" / f"{name}.jsonl"), block_size=16)
        assert len(trace.requests) == 200, name


def test_use_as_an_inner_node_is_not_a_success():
    """A finished conversation's history is a leaf again only because its newer turns were
    evicted: the hits it took as their prefix are not its own reuse."""
    policy = AdaptivePolicy(explore=1)
    tree, mem = _cache(policy)
    _request(tree, mem, [1, 2, 3, 4])
    _request(tree, mem, [1, 2, 3, 4, 5, 6, 7, 8])           # hits [1..4] as a leaf: a success
    twice = CLASS_NAMES.index(TWICE)
    assert policy.successes[CLASS_NAMES.index("new at root, < 16 tokens")] > 0.99
    _request(tree, mem, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])   # [1..4] only on the path
    _request(tree, mem, [50, 51])                               # (something newer keyed)
    mem.free(tree.evict(8))                                     # its newer turns go
    head = _leaf(tree, 4)
    assert not head.children and policy.class_of(head) == OFTEN
    assert policy.successes[twice] == 0.0                       # withdrawn, not a success
    tree.check_invariants()


def test_engine_serves_multi_turn_chats_with_it():
    """The engine's real scheduler and memory (null model, no torch) over a pool too small
    for every conversation: all turns finish, pages are conserved after every step (the
    bench checks), and later turns hit the cache."""
    import random

    sys.path.insert(0, str(REPO / "tests" / "scheduler"))
    from sched_harness import Bench, random_prompt

    bench = Bench(page_size=4, num_pages=160, token_budget=256)
    tree = bench.memory.tree
    assert tree.num_nodes == 0
    tree.policy = AdaptivePolicy(explore=2)      # what --eviction-policy adaptive builds
    rng = random.Random(0)
    system = random_prompt(rng, 40)
    histories = [list(system) for _ in range(6)]
    cached = 0
    for _ in range(5):
        ids = []
        for history in histories:
            history += random_prompt(rng, 20)
            ids.append(bench.submit(history, max_tokens=8).request_id)
        bench.run()
        for rid, history in zip(ids, histories):
            final = bench.final(rid)
            cached += final.usage.cached_tokens
            history += [t for out in bench.outputs[rid] for t in out.token_ids]
    assert tree.evicted_tokens > 0                       # the pool was too small
    assert cached > 0
    assert sum(tree.policy.trials) > 0 and tree.policy.horizon > 1.0   # it learned
    tree.check_invariants()
    assert tree.locked_tokens == 0
