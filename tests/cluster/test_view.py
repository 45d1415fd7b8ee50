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
    """A request sent as a miss owes its prefill until a digest taken since shows the
    prefix in its replica's cache (loaded from a peer with --kv-share): then only its
    decode is queued work."""
    state = ClusterState(BLOCK)
    state.keep_only(["a"])
    prompt = SYSTEM + [7] * 16
    hashes = prompt_hashes(prompt, BLOCK, None)
    state.routed("q", "a", hashes, len(prompt), True, len(prompt))
    assert state.replicas["a"].queued_prefill_tokens(BLOCK) == len(prompt)
    state.published("a", {"digest": digest(prompt)})
    assert state.replicas["a"].queued_prefill_tokens(BLOCK) == 0
    assert state.replicas["a"].in_flight == 1


FEWSHOT_PREFIX = list(range(1000, 1000 + 82 * BLOCK))      # bench_cluster's ~1,312 tokens


class Burst:
    """bench_cluster's few-shot run through the Ray router's policy, no Ray: 16 prompts
    sharing a prefix, 8 in flight at a time (a new one as each completes), 4 replicas."""

    def __init__(self, state: ClusterState, router: RadixRequestRouter):
        self.state, self.router = state, router
        self.sent: dict[str, list[int]] = {r: [] for r in state.replicas}
        self.live: dict[str, list[int]] = {r: [] for r in state.replicas}

    def prompt(self, i: int) -> list[int]:
        return FEWSHOT_PREFIX + [50_000 + i] * 36

    def send(self, i: int) -> str:
        pick = decide(self.state, self.prompt(i), router=self.router)
        info = RouteInfo(prompt_hashes(self.prompt(i), BLOCK, None), len(self.prompt(i)))
        pending = SimpleNamespace(args=[info], metadata=SimpleNamespace(
            internal_request_id=f"q{i}"))
        self.router.note(pending, pick, confirmed=False)           # the choice
        self.router.note(pending, pick, confirmed=True)            # Ray Serve sends it
        self.sent[pick].append(i)
        self.live[pick].append(i)
        return pick

    def complete(self, replica: str) -> None:
        """`replica`'s oldest request ends; its next digest holds what it was sent."""
        self.state.completed(f"q{self.live[replica].pop(0)}")
        self.state.published(replica, {"digest": digest(
            *(self.prompt(i) for i in self.sent[replica]))})


def test_fewshot_burst_with_sharing_spreads_evenly_however_unequal_the_replicas_speeds():
    """Issue 38's spread target (max/mean <= 1.3) with --kv-share: once every replica
    holds the prefix the choice is free, and the router balances it by the requests of
    the prefix it sent each replica. On the full run, by requests in flight alone, the
    replica that finished first took each next request (6 of 16, 1.50). Here the replica
    that computed the prefix finishes every request before any other finishes one. While
    the others hold the prefix only on paper (still waiting for its pages), the next
    request goes to the one that holds it: queued behind a wait, it was computed again."""
    state = ClusterState(BLOCK)
    state.keep_only(["r0", "r1", "r2", "r3"])
    burst = Burst(state, policy_router(state, load_fraction=0.25))
    first = [burst.send(i) for i in range(8)]
    assert sorted(len(v) for v in burst.sent.values()) == [2, 2, 2, 2]
    fast = first[0]                                     # computed the prefix: ends first
    burst.complete(fast)
    burst.complete(fast)
    assert burst.send(8) == fast                        # the others still wait for it
    for r in state.replicas:                            # they load it, then decode slowly
        if r != fast:
            state.published(r, {"digest": digest(*(burst.prompt(i) for i in burst.sent[r]))})
    for i in range(9, 16):
        done = fast if burst.live[fast] else min(
            (r for r in burst.live if burst.live[r]), key=lambda r: burst.live[r][0])
        burst.complete(done)
        burst.send(i)
    counts = sorted(len(v) for v in burst.sent.values())
    assert sum(counts) == 16 and max(counts) / 4 <= 1.25, counts
    loads = [state.replicas[r].in_flight for r in sorted(state.replicas)]
    bound = LoadBound()                                 # a slow replica stays within it
    assert max(loads) <= bound.factor * sum(loads) / 4 + bound.slack


def test_with_sharing_a_holder_still_beats_loaders_at_even_load_whatever_it_was_sent():
    """Balancing by the prefix's requests only decides between replicas that tie on the
    cache: a replica holding the prefix outranks those that would load it, even after
    it served every earlier request of that prefix."""
    state = ClusterState(BLOCK)
    state.keep_only(["a", "b", "c", "d"])
    router = policy_router(state, load_fraction=0.25)
    burst = Burst(state, router)
    holder = burst.send(0)
    for i in range(1, 6):                      # one at a time: each ends before the next
        burst.complete(holder)
        assert burst.send(i) == holder
    assert len(burst.sent[holder]) == 6 and state.replicas[holder].in_flight == 1
