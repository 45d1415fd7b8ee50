"""The router's view and the cache-aware decision, without a cluster."""

import time
from types import SimpleNamespace

from radixserve.cluster.cache_digest import CacheDigest
from radixserve.cluster.prefix_hashes import prompt_hashes
from radixserve.cluster.ray_router import RadixRequestRouter
from radixserve.cluster.route_info import RouteInfo
from radixserve.cluster.view import CandidateView, ClusterState
from radixserve.routing import LoadBound

BLOCK = 16
SYSTEM = list(range(100, 100 + 64))


def digest(*prompts, namespace=None, at=None) -> CacheDigest:
    held = set()
    for p in prompts:
        held.update(prompt_hashes(p, BLOCK, namespace))
    return CacheDigest(frozenset(held), BLOCK, time.time() if at is None else at)


def policy_router(state: ClusterState, policy="cache-aware", **kwargs) -> RadixRequestRouter:
    router = RadixRequestRouter.__new__(RadixRequestRouter)     # no Ray: policy only
    router.initialize_state(view_key="test-" + str(id(state)), policy=policy,
                            block_tokens=BLOCK, **kwargs)
    router.state = state
    return router


def decide(state: ClusterState, ids, policy="cache-aware", namespace=None,
           router: RadixRequestRouter | None = None) -> str:
    """The replica RadixRequestRouter's policy picks, over the state's replicas."""
    router = router or policy_router(state, policy)
    ids_sorted = sorted(state.replicas)
    hashes = prompt_hashes(ids, BLOCK, namespace)
    view = CandidateView([state.replicas[r] for r in ids_sorted], hashes, BLOCK,
                         router.prefill_seconds_per_token, router.decode_seconds_per_request)
    return ids_sorted[router.policy_index(view, RouteInfo(hashes, len(ids)))]


def test_cache_aware_picks_the_holder_unless_it_is_far_busier():
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b"])
    state.published("b", {"digest": digest(SYSTEM + [1] * 16)})
    state.published("a", {"digest": digest()})
    assert decide(state, SYSTEM + [2] * 16) == "b"
    for i in range(40):                       # b drowns in queued prefill: a wins
        state.routed(f"r{i}", "b", [], 2000, True)
    assert decide(state, SYSTEM + [2] * 16) == "a"


def test_other_namespace_is_not_credited():
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b"])
    state.published("a", {"digest": digest(SYSTEM, namespace="t1")})
    view = CandidateView([state.replicas["a"], state.replicas["b"]],
                         prompt_hashes(SYSTEM, BLOCK, "t2"), BLOCK, 1e-4, 0.0)
    assert view.cached_tokens(type("R", (), {"prompt_tokens": 64})()) == [0, 0]


def test_routed_requests_bridge_the_digest_lag_until_a_later_digest():
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b"])
    hashes = prompt_hashes(SYSTEM, BLOCK, None)
    state.routed("r1", "a", hashes, 64, True)
    assert state.replicas["a"].held_blocks(hashes) == 4 and state.replicas["a"].in_flight == 1
    state.completed("r1")
    assert state.replicas["a"].in_flight == 0
    assert state.replicas["a"].held_blocks(hashes) == 4          # digest not yet newer
    state.published("a", {"digest": digest()})                  # taken after: it was evicted
    assert state.replicas["a"].held_blocks(hashes) == 0


def test_forgetting_a_dead_replica_drops_its_view_and_an_older_digest_is_ignored():
    state = ClusterState(BLOCK)
    state.keep_only(["a"])
    state.published("a", {"digest": digest(SYSTEM, at=10.0)})
    state.published("a", {"digest": digest(at=5.0)})           # late, older: ignored
    assert len(state.replicas["a"].digest.hashes) == 4
    state.forget("a")
    assert state.replicas == {} and state.held_tokens() == 0


def test_nothing_cached_goes_to_the_prefix_home_while_loads_are_equal():
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b", "c", "d"])
    picks = {decide(state, SYSTEM + [i] * 16) for i in range(20)}
    assert len(picks) == 1                    # same first block: same home replica


def test_a_choice_counts_at_once_moves_when_rejected_and_expires_if_never_sent():
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b"])
    state.routed("r1", "a", [], 100, confirmed=False)       # chosen, not yet dispatched
    assert state.replicas["a"].in_flight == 1
    state.routed("r1", "b", [], 100, confirmed=True)        # a rejected it; b took it
    assert (state.replicas["a"].in_flight, state.replicas["b"].in_flight) == (0, 1)
    state.routed("r2", "a", [], 100, confirmed=False)
    state.replicas["a"].routed["r2"].routed_at -= 60        # never dispatched: expires
    assert state.replicas["a"].in_flight == 0


def test_a_burst_counts_choices_not_yet_dispatched_and_stays_within_the_load_bound():
    """Every request of a burst is decided before any is dispatched or completes: each
    choice must count (in flight, and its prefix held) for the next one."""
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b", "c", "d"])
    state.published("b", {"digest": digest(SYSTEM)})
    for i in range(16):
        ids = SYSTEM + [i] * 16
        pick = decide(state, ids)
        if i == 0:
            assert pick == "b"                          # the holder, while it has room
        state.routed(f"r{i}", pick, prompt_hashes(ids, BLOCK, None), 16, confirmed=False)
        loads = [state.replicas[r].in_flight for r in "abcd"]
        bound = LoadBound()                             # the default, after each choice
        assert max(loads) <= bound.factor * sum(loads) / 4 + bound.slack
    assert sum(state.replicas[r].in_flight for r in "abcd") == 16
    assert state.replicas["b"].in_flight == max(state.replicas[r].in_flight for r in "abcd")


def test_a_request_that_loaded_its_prefix_no_longer_counts_as_a_prefill():
    """bench_cluster's few-shot burst with --kv-share ray (decisions recorded with
    --decisions): 16 prompts sharing a 1,312-token prefix, 8 at a time. The first wave
    spreads 2/2/2/2: one replica computes the prefix, the others wait for it and load it.
    The computing one finishes first and takes two more (fewest in flight). Then a loader
    finishes its second request and keeps its first in flight (decoding: its digest shows
    the prefix loaded); the holder has two hits in flight. The next request must go to
    the loader. Before, a request kept the prefill it was sent with (a miss: 1,348 tokens)
    until it completed, so the loader looked busier (0.37 s against 0.21 s) and the holder
    took a sixth request of 16 (max/mean 1.50)."""
    state = ClusterState(BLOCK)
    state.keep_only(["r0", "r1", "r2", "r3"])
    router = policy_router(state, load_fraction=0.25)
    prefix = list(range(1000, 1000 + 82 * BLOCK))
    prompts = [prefix + [50_000 + i] * 36 for i in range(11)]
    sent: dict[str, list[int]] = {r: [] for r in state.replicas}

    def send(i: int) -> str:
        pick = decide(state, prompts[i], router=router)
        info = RouteInfo(prompt_hashes(prompts[i], BLOCK, None), len(prompts[i]))
        pending = SimpleNamespace(args=[info], metadata=SimpleNamespace(
            internal_request_id=f"q{i}"))
        router.note(pending, pick, confirmed=True)
        sent[pick].append(i)
        return pick

    first = [send(i) for i in range(8)]
    holder, loader = first[0], first[1]
    assert sorted(len(v) for v in sent.values()) == [2, 2, 2, 2]
    for i in sent[holder]:
        state.completed(f"q{i}")
    state.published(holder, {"digest": digest(*(prompts[i] for i in sent[holder]))})
    assert send(8) == send(9) == holder                 # fewest in flight
    state.completed(f"q{sent[loader][1]}")              # the loader's second finishes
    state.published(loader, {"digest": digest(*(prompts[i] for i in sent[loader]))})
    assert send(10) == loader
