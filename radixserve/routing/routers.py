"""Routing policies: which replica serves a request.

Every policy implements `Router.choose(request, view) -> replica index` and may keep its
own state through `Router.routed(request, replica)`, called after each decision. What a
policy may read is the `ClusterView`: queue lengths and queued work per replica (what any
load balancer knows) and, for the cache-aware policy only, the prompt tokens each replica
holds (a serving cluster learns them from the replicas' published prefix hashes).

A request is described by its chained page keys: key i names page i of the prompt together
with everything before it (block ids of a hash-id trace, or a hash chained over pages), so
equal keys mean equal prefixes and a prefix match is a walk over the keys.
"""

from __future__ import annotations

import hashlib
import math
import random
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .spread import PrefixSpread


@dataclass(frozen=True, slots=True)
class RouteRequest:
    page_keys: Sequence[int]   # chained key of each prompt page, in order
    prompt_tokens: int
    routing_key: int | None = None  # stable hash of a prompt_cache_key: replaces the first
                                    #   page as the sticky key (ties, consistent hashing)

    @property
    def sticky_key(self) -> int:
        if self.routing_key is not None:
            return self.routing_key
        return self.page_keys[0] if len(self.page_keys) else 0


class ClusterView(Protocol):
    """What a router may know about the replicas when it decides."""

    num_replicas: int

    def queued_requests(self) -> Sequence[int]:
        """Requests waiting or running on each replica."""

    def queued_seconds(self) -> Sequence[float]:
        """Work left on each replica, in seconds (queued prefill and decode)."""

    def cached_tokens(self, request: RouteRequest) -> Sequence[int]:
        """Prompt tokens of `request` each replica would serve from its cache."""

    def shared_tokens(self, request: RouteRequest) -> int:
        """Prompt tokens of `request` any replica could load from the cluster store
        (--kv-share; read only by a router built with a `load_fraction`)."""

    def settled(self, request: RouteRequest) -> Sequence[bool]:
        """Per replica: what it holds of `request` is really in its cache, not only booked
        for requests still computing or loading it (--kv-share; a view without a cluster
        store answers True for every replica)."""


def stable_hash(*parts: int) -> int:
    """A 64-bit hash that is the same in every process (Python's hash() is salted)."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def cache_key_hash(prompt_cache_key: str | None) -> int | None:
    """A `prompt_cache_key` as a routing key (the same in every process)."""
    if prompt_cache_key is None:
        return None
    digest = hashlib.blake2b(prompt_cache_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rendezvous(key: int, candidates: Sequence[int]) -> int:
    """The candidate with the highest hash of (key, candidate): a stable, spread-out pick."""
    return max(candidates, key=lambda r: stable_hash(key, r))


class Router(ABC):
    name = "router"

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas

    @abstractmethod
    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        """The replica that serves `request`."""

    def routed(self, request: RouteRequest, replica: int) -> None:
        """Called after each decision (policies with memory update it here)."""


class RoundRobinRouter(Router):
    """Replicas in turn, blind to load and cache."""

    name = "round-robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = 0

    def choose(self, request, view):
        r = self._next
        self._next = (r + 1) % self.num_replicas
        return r


class PowerOfTwoRouter(Router):
    """Two replicas at random, the one with the shorter queue (Mitzenmacher's two choices)."""

    name = "pow2"

    def __init__(self, num_replicas: int, seed: int = 0):
        super().__init__(num_replicas)
        self._rng = random.Random(seed)

    def choose(self, request, view):
        return self.pick(range(self.num_replicas), view.queued_requests())

    def pick(self, candidates: Sequence[int], queued: Sequence[int]) -> int:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if queued[a] <= queued[b] else b


class ConsistentHashRouter(Router):
    """The request's first pages hashed onto a ring of replicas: sticky, load-blind."""

    name = "consistent-hash"

    def __init__(self, num_replicas: int, key_pages: int = 1, virtual_nodes: int = 64):
        super().__init__(num_replicas)
        self.key_pages = key_pages
        ring = sorted((stable_hash(r, v), r) for r in range(num_replicas)
                      for v in range(virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def choose(self, request, view):
        keys = request.page_keys[: self.key_pages]
        h = stable_hash(*keys) if len(keys) else 0
        if request.routing_key is not None:
            h = request.routing_key
        i = bisect_right(self._points, h) % len(self._points)
        return self._owners[i]


class PrefixAffinityRouter(Router):
    """Ray Serve LLM's PrefixCacheAffinityRouter, on page keys: the router's own prefix view.

    The router remembers which pages it sent where (per replica, least recently routed
    pages forgotten beyond `capacity_pages`), not what the replicas hold. As in Ray: while
    queues are balanced (longest - shortest <= `imbalance`, unbounded by default) a request
    goes to the replica(s) whose routed history shares its longest prefix when that covers
    at least `match_threshold` of the prompt, and otherwise to the replica(s) with the
    smallest history (the least used cache); ties, an empty history and imbalanced queues
    go to power of two choices.
    """

    name = "prefix-affinity"

    def __init__(self, num_replicas: int, capacity_pages: int, imbalance: float = math.inf,
                 match_threshold: float = 0.1, seed: int = 0):
        super().__init__(num_replicas)
        self.capacity_pages = max(1, capacity_pages)
        self.imbalance = imbalance
        self.match_threshold = match_threshold
        self._pow2 = PowerOfTwoRouter(num_replicas, seed)
        self._holders: dict[int, set[int]] = {}          # page key -> replicas sent it
        self._history = [OrderedDict() for _ in range(num_replicas)]

    def longest_match(self, request: RouteRequest) -> tuple[list[int], int]:
        """Replicas whose routed history shares the longest prefix, and its length in pages."""
        best: set[int] = set()
        depth = 0
        for key in request.page_keys:
            holders = self._holders.get(key)
            if not holders:
                break
            narrowed = holders & best if depth else holders
            if not narrowed:
                break
            best, depth = narrowed, depth + 1
        return sorted(best), depth

    def choose(self, request, view):
        queued = view.queued_requests()
        if self._holders and max(queued) - min(queued) <= self.imbalance:
            best, depth = self.longest_match(request)
            if best and depth / max(1, len(request.page_keys)) >= self.match_threshold:
                return self._pow2.pick(best, queued)
            sizes = [len(h) for h in self._history]
            least = min(sizes)
            return self._pow2.pick([r for r, n in enumerate(sizes) if n == least], queued)
        return self._pow2.pick(range(self.num_replicas), queued)

    def routed(self, request, replica):
        history = self._history[replica]
        for key in request.page_keys:
            if key in history:
                history.move_to_end(key)
            else:
                history[key] = None
                self._holders.setdefault(key, set()).add(replica)
        while len(history) > self.capacity_pages:
            key, _ = history.popitem(last=False)
            holders = self._holders[key]
            holders.discard(replica)
            if not holders:
                del self._holders[key]


@dataclass(frozen=True)
class LoadBound:
    """Bounded loads (consistent hashing with bounded loads, Mirrokni et al.; SGLang's
    router balances the same way, with an absolute and a relative threshold): after this
    request, a replica may hold at most `factor` x the mean requests in flight + `slack`.

    The slack keeps the bound from binding on a lightly loaded cluster, where the mean is
    below one and a replica with two requests would otherwise count as overloaded. The
    least loaded replica always qualifies (slack >= 1); `factor` = inf is no bound at all.
    """

    factor: float = 2.0
    slack: float = 2.0

    def __post_init__(self):
        if not (self.factor >= 1 and self.slack >= 1):
            raise ValueError(f"a load bound needs factor >= 1 and slack >= 1, got {self}")

    def candidates(self, queued: Sequence[int]) -> list[int]:
        """The replicas that may take one more request."""
        n = len(queued)
        limit = self.factor * (sum(queued) + 1) / n + self.slack
        return [r for r, q in enumerate(queued) if q + 1 <= limit]

    @classmethod
    def parse(cls, text: str) -> "LoadBound":
        """'C' (default slack) or 'C+S', e.g. '1.25+2'; 'inf' for no bound."""
        factor, _, slack = str(text).partition("+")
        try:
            return cls(float(factor), float(slack) if slack else cls.slack)
        except ValueError:
            raise ValueError(f"bad load bound {text!r}: want C or C+S with C >= 1, S >= 1 "
                             f"(e.g. 1.25+2), or inf") from None

    def __str__(self) -> str:
        return f"{self.factor:g}+{self.slack:g}"


def load_bound_arg(text: str) -> LoadBound:
    """`LoadBound.parse` for argparse, whose error line names the type by `__name__`."""
    return LoadBound.parse(text)


load_bound_arg.__name__ = "load bound"      # "invalid load bound value: '0.5'"


@dataclass(frozen=True, slots=True)
class Ranking:
    """A cache-aware decision before its tie-break."""

    candidates: list[int]      # replicas within the load bound
    scores: list[float]        # every replica's score (lower is better)
    tied: list[int]            # the candidates left for the rendezvous tie-break
    assigned: list[int] | None = None   # with sharing: each replica's recent requests of
                                        #   this prefix (PrefixSpread), None without


class CacheAwareRouter(Router):
    """Bounded load first, then least estimated time to first token from what each replica
    really holds.

    Only replicas within the load bound (`LoadBound` on the requests in flight, counted by
    the router itself from the moment it routes one) are candidates: this caps
    how far one popular prefix can pile work onto its holder, at the price of computing
    that prefix again on a second replica. Among the candidates, the score of a replica is
    its queued work (seconds) + `cache_weight` x the prefill of the prompt tokens it does
    not hold; the cached tokens come from the replicas themselves, so a hit is only counted
    where the prefix still is. Equal scores (idle replicas holding nothing of the prompt)
    are broken by a rendezvous hash of the first page key, so new prefixes spread out and
    their follow-ups find them.

    With sharing (`load_fraction` set: --kv-share), a token the replica does not hold but
    the cluster store does (`view.shared_tokens`) costs `load_fraction` x its prefill
    (loading it, < 1) instead of its whole prefill. The score ranks a replica holding the
    prefix first, one that can load it second, a miss last, and since loading is cheap the
    load bound and queued work decide far more often: the load spreads.

    Also with sharing, the candidates whose cache term equals the best-scored one's (they
    all hold the prefix, or all can load it: nothing to gain in prefill between them) are
    balanced by the requests of this prefix the router itself sent each one recently
    (`PrefixSpread`), then by score: join-the-shortest-queue on them would follow the
    replicas' speed (whoever finished first takes the next request) and pile a burst onto
    the fastest. The load bound still caps a slow replica. A miss everywhere is not
    balanced this way: a new prefix goes to its home (rendezvous) so followers find it.
    Nor is a replica that holds the prefix only on paper (`view.settled`: booked for
    requests still waiting for a peer's pages or computing them): more of the prefix's
    requests there would queue behind that wait, and a replica whose store lookups run
    late computes them instead (measured: the prefix computed up to 4 times on few-shot).
    """

    name = "cache-aware"

    def __init__(self, num_replicas: int, prefill_seconds_per_token: float,
                 cache_weight: float = 4.0, load_bound: LoadBound = LoadBound(),
                 load_fraction: float | None = None, spread_window: int = 64):
        super().__init__(num_replicas)
        if prefill_seconds_per_token < 0 or cache_weight < 0:
            raise ValueError("prefill cost and cache weight must be >= 0")
        if load_fraction is not None and not 0 <= load_fraction < 1:
            raise ValueError(f"a load fraction is in [0, 1), got {load_fraction}")
        self.load_fraction = load_fraction
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.cache_weight = cache_weight
        self.load_bound = load_bound
        self.spread = PrefixSpread(spread_window)

    def cache_costs(self, request: RouteRequest, view: ClusterView) -> tuple[list[float],
                                                                            list[int]]:
        """Each replica's cache term (seconds: weighted prefill of what it lacks, a load at
        its fraction) and the prompt tokens it holds or could load."""
        cached = view.cached_tokens(request)
        cost = self.prefill_seconds_per_token * self.cache_weight
        L = request.prompt_tokens
        if self.load_fraction is None:
            return [cost * (L - c) for c in cached], list(cached)
        shared = view.shared_tokens(request)
        f = self.load_fraction
        return ([cost * (L - max(c, shared) + f * max(0, shared - c)) for c in cached],
                [max(c, shared) for c in cached])

    def scores(self, request: RouteRequest, view: ClusterView) -> list[float]:
        cache, _ = self.cache_costs(request, view)
        return [q + c for q, c in zip(view.queued_seconds(), cache)]

    def ranked(self, request: RouteRequest, view: ClusterView,
               ids: Sequence[Hashable] | None = None) -> Ranking:
        """The candidates within the load bound, every replica's score, and those left to
        the tie-break: the best-scored, or with sharing the least assigned of those that
        tie with it on the cache (see the class docstring). `ids`: the replicas' stable
        identities for `PrefixSpread` (default: their indices)."""
        candidates = self.load_bound.candidates(view.queued_requests())
        cache, reach = self.cache_costs(request, view)
        scores = [q + c for q, c in zip(view.queued_seconds(), cache)]
        best = min(candidates, key=lambda r: scores[r])
        balance = self.load_fraction is not None and reach[best] > 0
        settled = view.settled(request) if balance else None
        if not balance or not settled[best]:   # no sharing, a miss, or held only on paper
            return Ranking(candidates, scores,
                           [r for r in candidates if scores[r] == scores[best]])
        ids = range(view.num_replicas) if ids is None else ids
        assigned = self.spread.counts(request.page_keys, list(ids)[:len(scores)])
        even = [r for r in candidates if cache[r] == cache[best] and settled[r]]
        least = min(assigned[r] for r in even)
        even = [r for r in even if assigned[r] == least]
        low = min(scores[r] for r in even)
        return Ranking(candidates, scores, [r for r in even if scores[r] == low], assigned)

    def choose(self, request, view):
        return self.pick(request, self.ranked(request, view))

    def routed(self, request: RouteRequest, replica: Hashable) -> None:
        """Book the request on its replica for the sharing tie-break (`PrefixSpread`)."""
        if self.load_fraction is not None:
            self.spread.record(request.page_keys, replica)

    def pick(self, request: RouteRequest, ranking: Ranking) -> int:
        tied = ranking.tied
        if len(tied) == 1:
            return tied[0]
        return rendezvous(request.sticky_key, tied)


ROUTERS = ("cache-aware", "prefix-affinity", "pow2", "round-robin", "consistent-hash")


def make_router(name: str, num_replicas: int, *, capacity_pages: int,
                prefill_seconds_per_token: float, cache_weight: float = 4.0,
                load_bound: LoadBound = LoadBound(), seed: int = 0,
                load_fraction: float | None = None) -> Router:
    """A fresh router by name."""
    if name == "round-robin":
        return RoundRobinRouter(num_replicas)
    if name == "pow2":
        return PowerOfTwoRouter(num_replicas, seed)
    if name == "consistent-hash":
        return ConsistentHashRouter(num_replicas)
    if name == "prefix-affinity":
        return PrefixAffinityRouter(num_replicas, capacity_pages, seed=seed)
    if name == "cache-aware":
        return CacheAwareRouter(num_replicas, prefill_seconds_per_token, cache_weight, load_bound,
                                load_fraction)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
