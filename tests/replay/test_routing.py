"""The routing policies on a hand-made view of the replicas (no cache, no clock)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from radixserve.routing import (CacheAwareRouter, ConsistentHashRouter, LoadBound,
                                PowerOfTwoRouter, PrefixAffinityRouter, RoundRobinRouter,
                                RouteRequest, make_router)


@dataclass
class View:
    num_replicas: int
    queued: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def queued_requests(self):
        return self.queued or [0] * self.num_replicas

    def queued_seconds(self):
        return self.seconds or [0.0] * self.num_replicas

    def cached_tokens(self, request):
        return self.cached or [0] * self.num_replicas

    def settled(self, request):
        return [True] * self.num_replicas


def req(*keys, tokens=None):
    return RouteRequest(list(keys), tokens if tokens is not None else 512 * len(keys))


def test_round_robin_cycles():
    r = RoundRobinRouter(3)
    assert [r.choose(req(1), View(3)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_pow2_never_picks_the_longer_of_its_two():
    r = PowerOfTwoRouter(2, seed=1)
    assert {r.choose(req(1), View(2, queued=[5, 1])) for _ in range(20)} == {1}


def test_consistent_hash_is_sticky_and_the_same_in_every_instance():
    a, b = ConsistentHashRouter(8), ConsistentHashRouter(8)
    picks = [a.choose(req(k, 99), View(8)) for k in range(200)]
    assert picks == [b.choose(req(k, 7), View(8)) for k in range(200)]   # first page only
    assert len(set(picks)) == 8


def test_prefix_affinity_follows_history_while_balanced():
    r = PrefixAffinityRouter(4, capacity_pages=100, imbalance=2)
    first = req(1, 2, 3)
    home = r.choose(first, View(4))
    r.routed(first, home)
    follow = req(1, 2, 3, 4)
    assert r.longest_match(follow) == ([home], 3)
    assert r.choose(follow, View(4)) == home
    # Imbalanced queues: power of two choices instead (never the overloaded home).
    queued = [0, 0, 0, 0]
    queued[home] = 10
    assert all(r.choose(follow, View(4, queued=queued)) != home for _ in range(20))


def test_prefix_affinity_forgets_beyond_its_capacity():
    r = PrefixAffinityRouter(2, capacity_pages=2)
    r.routed(req(1, 2), 0)
    r.routed(req(5, 6), 0)           # pushes pages 1 and 2 out of replica 0's history
    assert r.longest_match(req(1, 2)) == ([], 0)
    assert r.longest_match(req(5, 6)) == ([0], 2)


def test_cache_aware_weighs_cached_prefill_against_queued_seconds():
    r = CacheAwareRouter(2, prefill_seconds_per_token=0.001, cache_weight=1.0)
    request = req(1, 2, tokens=1000)
    # Replica 0 holds 900 tokens (saves 0.9 s) but has 0.5 s queued: it wins.
    assert r.choose(request, View(2, seconds=[0.5, 0.0], cached=[900, 0])) == 0
    # With 1.0 s queued, the idle replica wins.
    assert r.choose(request, View(2, seconds=[1.0, 0.0], cached=[900, 0])) == 1
    # A higher weight keeps the prefix where it is.
    heavy = CacheAwareRouter(2, prefill_seconds_per_token=0.001, cache_weight=4.0)
    assert heavy.choose(request, View(2, seconds=[1.0, 0.0], cached=[900, 0])) == 0


def test_cache_aware_spreads_new_prefixes_by_hash():
    r = CacheAwareRouter(8, prefill_seconds_per_token=0.001)
    picks = {r.choose(req(k), View(8)) for k in range(100)}
    assert len(picks) == 8


def test_unknown_router():
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random", 2, capacity_pages=1, prefill_seconds_per_token=0.0)


def test_load_bound_admits_replicas_up_to_factor_times_the_mean_plus_slack():
    # After this request: at most C x mean + S in flight, i.e. q + 1 <= C x (sum + 1) / n + S.
    tight = LoadBound(1.1, 1)
    assert tight.candidates([0, 0, 0, 0]) == [0, 1, 2, 3]
    assert tight.candidates([1, 0, 0, 0]) == [1, 2, 3]
    assert tight.candidates([1, 1, 1, 0]) == [0, 1, 2, 3]
    assert LoadBound(2.0, 1).candidates([5, 0, 0, 0]) == [1, 2, 3]
    assert LoadBound(1.25, 2).candidates([2, 1, 0, 0]) == [0, 1, 2, 3]   # the slack
    assert LoadBound(1.25, 1).candidates([2, 1, 0, 0]) == [1, 2, 3]
    assert LoadBound(1.25, 2).candidates([3, 1, 0, 0]) == [1, 2, 3]
    assert LoadBound(math.inf).candidates([5, 0, 0, 0]) == [0, 1, 2, 3]


def test_load_bound_parses_and_prints_c_plus_s():
    assert LoadBound.parse("1.5") == LoadBound(1.5, LoadBound().slack)
    assert LoadBound.parse("1.25+3") == LoadBound(1.25, 3)
    assert LoadBound.parse(str(LoadBound())) == LoadBound()
    assert LoadBound.parse("inf").candidates([9, 0]) == [0, 1]
    for bad in ("0.5", "2+0", "x", "1+y"):
        with pytest.raises(ValueError):
            LoadBound.parse(bad)


def test_the_least_loaded_replica_is_always_within_the_bound():
    rng = random.Random(3)
    for _ in range(500):
        queued = [rng.randrange(20) for _ in range(rng.randrange(1, 9))]
        assert queued.index(min(queued)) in LoadBound(1.0, 1.0).candidates(queued)


def test_cache_aware_keeps_a_prefix_on_its_holder_only_within_the_load_bound():
    r = CacheAwareRouter(4, prefill_seconds_per_token=0.001, load_bound=LoadBound(1.1, 1))
    request = req(1, 2, tokens=1000)

    def view(queued):
        return View(4, queued=queued, seconds=[0.1 * q for q in queued], cached=[900, 0, 0, 0])
    assert r.choose(request, view([1, 1, 1, 0])) == 0
    # One more in flight on the holder: it is over the bound, the request goes elsewhere
    # (to the least loaded) however much the holder would save.
    assert r.choose(request, view([2, 1, 1, 0])) == 3
    # Without a bound, the saved prefill outweighs the queue.
    free = CacheAwareRouter(4, prefill_seconds_per_token=0.001,
                            load_bound=LoadBound(math.inf))
    assert free.choose(request, view([2, 1, 1, 0])) == 0


def test_a_burst_on_one_prefix_spreads_evenly_and_follows_the_copies():
    """All requests arrive before any completes (counted in flight at once): the prefix
    is copied to replica after replica as the bound forces, and the counts stay level."""
    r = CacheAwareRouter(4, prefill_seconds_per_token=0.001, load_bound=LoadBound(1.1, 1))
    queued, holders = [0, 0, 0, 0], set()
    for _ in range(16):
        cached = [900 if i in holders else 0 for i in range(4)]
        pick = r.choose(req(1, 2, tokens=1000),
                        View(4, list(queued), [0.1 * q for q in queued], cached))
        queued[pick] += 1
        holders.add(pick)
    assert queued == [4, 4, 4, 4]


def test_prefix_spread_counts_the_longest_routed_prefix_within_its_window():
    from radixserve.routing.spread import PrefixSpread

    spread = PrefixSpread(window=3)
    spread.record([1, 2, 3], "a")
    spread.record([1, 2, 4], "b")
    spread.record([1, 5], "a")
    assert spread.counts([1, 2, 9], ["a", "b", "c"]) == [1, 1, 0]   # shares [1, 2]
    assert spread.counts([1, 7], ["a", "b"]) == [2, 1]              # shares [1] only
    assert spread.counts([8], ["a", "b"]) == [0, 0]
    spread.record([1, 2], "c")                                     # [1]'s window: 3
    assert spread.counts([1], ["a", "b", "c"]) == [1, 1, 1]


@dataclass
class ShareView(View):
    shared: int = 0
    ready: list[bool] = field(default_factory=list)

    def shared_tokens(self, request):
        return self.shared

    def settled(self, request):
        return self.ready or [True] * self.num_replicas


def test_with_sharing_cache_ties_balance_by_the_prefix_requests_sent_not_the_queue():
    # Four replicas all hold the prefix; one keeps finishing first (fewest in flight).
    # Join-the-shortest-queue would send it every request; the router spreads them by
    # what it sent each replica with this prefix, so after 12 each has 3.
    router = CacheAwareRouter(4, 1e-3, load_fraction=0.25)
    prompt = req(1, 2, 3, tokens=1536)
    sent = [0] * 4
    for i in range(12):
        view = ShareView(4, queued=[0, 2, 2, 2], seconds=[0.0, 0.2, 0.2, 0.2],
                         cached=[1024] * 4, shared=1024)
        r = router.choose(prompt, view)
        router.routed(prompt, r)
        sent[r] += 1
    assert sent == [3, 3, 3, 3]
    # The load bound still caps a replica that falls behind: past it, it gets nothing.
    behind = ShareView(4, queued=[9, 0, 0, 0], cached=[1024] * 4, shared=1024)
    assert router.choose(prompt, behind) != 0
    # Without sharing the score alone decides, as before: the shortest queue.
    plain = CacheAwareRouter(4, 1e-3)
    assert {plain.choose(prompt, View(4, queued=[0, 2, 2, 2], seconds=[0.0, 0.2, 0.2, 0.2],
                                      cached=[1024] * 4)) for _ in range(5)} == {0}


def test_with_sharing_a_held_prefix_beats_a_loadable_one_when_the_load_is_even():
    router = CacheAwareRouter(4, 1e-3, load_fraction=0.25)
    prompt = req(1, 2, 3, tokens=1536)
    for _ in range(6):                      # replica 2 was sent this prefix many times
        router.routed(prompt, 2)
    view = ShareView(4, cached=[0, 0, 1024, 0], shared=1024)
    assert router.choose(prompt, view) == 2
    # A miss everywhere is not balanced: a new prefix goes to its home every time.
    new = req(9, 8, tokens=1024)
    homes = set()
    for _ in range(4):
        r = router.choose(new, ShareView(4))
        router.routed(new, r)
        homes.add(r)
    assert len(homes) == 1


def test_with_sharing_a_replica_holding_the_prefix_only_on_paper_is_not_balanced_onto():
    # Replicas 1-3 were sent the prefix but are still waiting for its pages: balancing
    # onto them would queue the request behind that wait; the score decides (replica 0).
    router = CacheAwareRouter(4, 1e-3, load_fraction=0.25)
    prompt = req(1, 2, 3, tokens=1536)
    for _ in range(3):
        router.routed(prompt, 0)
    view = ShareView(4, queued=[1, 2, 2, 2], seconds=[0.1, 0.2, 0.2, 0.2],
                     cached=[1024] * 4, shared=1024, ready=[True, False, False, False])
    assert router.choose(prompt, view) == 0
    view.ready = [True, True, False, False]          # replica 1 has loaded it: balanced
    assert router.choose(prompt, view) == 1
