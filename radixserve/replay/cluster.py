"""Cluster simulation: N replicas, each its own cache, fed over time by a routing policy.

Each replica is a plain replay (`_Run`: its own RadixCache, allocator and eviction policy at
the per-replica capacity), so a replica's cache does exactly what `radixserve replay` does
with the requests it is sent. Time comes from the trace's timestamps and a service-time
model: a replica serves its requests one after another, first come first served, each
taking prefill seconds per computed (uncached) prompt token plus decode seconds per output
token. The router (radixserve.routing) sees each replica's queue when a request arrives;
the cache-aware router also sees the prompt tokens each replica holds at that moment.

With sharing (`share_tokens`: --share, as `--kv-share` serves it), one more cache stands for
the cluster store: a request's prompt is published into it when its prefill ends on its
replica (write-through), and a replica that misses part of a prompt the store holds loads
that part instead of computing it, at `share_load_fraction` of its prefill time. A prompt
part another replica is computing (claimed, not yet published: a burst for a new prefix)
is waited for and then loaded, as the serving replicas do (engine/peer_share.py: a wait
ends when the claim does, and a live claimer publishes); the replica is held meanwhile. Loaded tokens
count as hits (`loaded_tokens` says how many); the cache-aware router scores them as
loadable.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.routing import LoadBound, RouteRequest, Router, make_router

from .belady import OFFLINE_POLICIES
from .replayer import HitCounts, ReplayConfig, _Run
from .workload import Workload


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Seconds a replica spends on a request: per computed prompt token, per output token."""

    prefill_seconds_per_token: float = 5e-5
    decode_seconds_per_token: float = 1e-3

    def __post_init__(self):
        if self.prefill_seconds_per_token < 0 or self.decode_seconds_per_token < 0:
            raise ValueError("service costs must be >= 0 seconds per token")

    def seconds(self, computed_tokens: int, output_tokens: int) -> float:
        return (computed_tokens * self.prefill_seconds_per_token
                + output_tokens * self.decode_seconds_per_token)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    replicas: int
    router: str
    capacity_tokens: int             # per replica
    policy: str = "lru"
    concurrency: int = 1
    warmup_fraction: float = 0.0
    service: ServiceModel = ServiceModel()
    seconds_per_time_unit: float = 1e-3   # trace timestamps in ms (Mooncake)
    cache_weight: float = 4.0             # cache-aware router: see routing/routers.py
    seed: int = 0
    check_every: int = 0                  # check each replica's cache every N requests
    load_bound: LoadBound = LoadBound()   # cache-aware router: see routing/routers.py
    share_tokens: int = 0                 # the cluster store's capacity (0: no sharing)
    share_load_fraction: float = 0.25     # a loaded token's time / a computed token's

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.policy in OFFLINE_POLICIES and self.replicas > 1:
            raise ValueError(f"the offline policy {self.policy!r} needs each replica's future "
                             "requests, which depend on the routing: not available with "
                             "--replicas > 1")


@dataclass(slots=True)
class ClusterStats(HitCounts):
    """What one (replicas, router, capacity, policy) simulation measured."""

    replicas: int
    router: str
    capacity_tokens: int
    policy: str
    requests: int = 0
    measured_requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    unfit_requests: int = 0
    replica_requests: list[int] = field(default_factory=list)
    replica_busy_seconds: list[float] = field(default_factory=list)
    wait_p50: float = 0.0
    wait_p99: float = 0.0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    seconds: float = 0.0
    share_tokens: int = 0           # the cluster store's capacity (0: no sharing)
    loaded_tokens: int = 0          # prompt tokens loaded from the store (in hit_tokens)

    @property
    def load_spread(self) -> float:
        """Busiest replica's service time over the mean: 1.0 is a perfect spread."""
        busy = self.replica_busy_seconds
        mean = sum(busy) / len(busy) if busy else 0.0
        return max(busy) / mean if mean else 1.0

    @property
    def request_spread(self) -> float:
        n = self.replica_requests
        mean = sum(n) / len(n) if n else 0.0
        return max(n) / mean if mean else 1.0

    def to_dict(self) -> dict:
        return {
            "replicas": self.replicas, "router": self.router,
            "capacity_tokens": self.capacity_tokens, "policy": self.policy,
            "requests": self.requests, "measured_requests": self.measured_requests,
            "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.token_hit_rate, "prefill_tokens": self.prefill_tokens,
            "hit_requests": self.hit_requests, "request_hit_rate": self.request_hit_rate,
            "unfit_requests": self.unfit_requests,
            "load_spread": self.load_spread, "request_spread": self.request_spread,
            "replica_requests": self.replica_requests,
            "replica_busy_seconds": self.replica_busy_seconds,
            "wait_p50_s": self.wait_p50, "wait_p99_s": self.wait_p99,
            "ttft_p50_s": self.ttft_p50, "ttft_p99_s": self.ttft_p99,
            "seconds": self.seconds,
            "share_tokens": self.share_tokens, "loaded_tokens": self.loaded_tokens,
        }


class _Replicas:
    """The replicas' caches and queues, and the ClusterView the router reads."""

    def __init__(self, workload: Workload, config: ClusterConfig):
        run_config = ReplayConfig(config.capacity_tokens, config.policy, config.concurrency,
                                  check_every=config.check_every)
        self.runs = [_Run(workload, run_config) for _ in range(config.replicas)]
        self.num_replicas = config.replicas
        self.space = workload.space
        self.busy_until = [0.0] * config.replicas
        self.finishes: list[deque[float]] = [deque() for _ in range(config.replicas)]
        self.now = 0.0
        self.item = None          # the request being routed (its keys, for cached_tokens)
        self.store = (_Run(workload, ReplayConfig(config.share_tokens, "lru", 1))
                      if config.share_tokens else None)     # the cluster store
        self.items = list(workload) if config.share_tokens else []
        # With a store: when each replica's cache really holds each page key (the end of
        # the first prefill there that computed or loaded it), for `settled`.
        self.ready: list[dict[int, float]] = [{} for _ in range(config.replicas)]

    def queued_requests(self) -> list[int]:
        now = self.now
        for q in self.finishes:
            while q and q[0] <= now:
                q.popleft()
        return [len(q) for q in self.finishes]

    def queued_seconds(self) -> list[float]:
        now = self.now
        return [b - now if b > now else 0.0 for b in self.busy_until]

    def cached_tokens(self, request: RouteRequest) -> list[int]:
        """Each replica's hit tokens for the request being routed (`self.item`, whose page
        keys `request` carries), read from its cache without touching it."""
        item, space = self.item, self.space
        L = item.prompt_len
        limit = space.max_match_keys(L)
        return [self._held(run, item) for run in self.runs]

    def shared_tokens(self, request: RouteRequest) -> int:
        """The prompt tokens another replica could load (0 without a store): what the store
        holds, or any replica holds or is computing (it publishes them when its prefill
        ends, and a replica that needs them meanwhile waits for that: its claim). The
        serving router's view counts the same (cluster/view.py)."""
        if self.store is None:
            return 0
        return max(self._held(self.store, self.item), *self.cached_tokens(request))

    def settled(self, request: RouteRequest) -> list[bool]:
        """Per replica: the pages of the request it holds are in its cache by now, not
        only booked for a prefill still running there (the serving view: its digest)."""
        item, space, tps = self.item, self.space, self.space.tree_page_size
        limit = space.max_match_keys(item.prompt_len)
        out = []
        for run, ready in zip(self.runs, self.ready):
            pages = run.cache.peek_prefix(item.prompt_keys, max_tokens=limit) // tps
            at = ready.get(item.prompt_keys[(pages - 1) * tps]) if pages else None
            out.append(not pages or (at is not None and at <= self.now))
        return out

    def mark_ready(self, replica: int, item, at: float) -> None:
        """`item`'s prompt pages are in `replica`'s cache from `at` (its prefill's end)."""
        ready, keys = self.ready[replica], item.prompt_keys
        for k in range(0, len(keys), self.space.tree_page_size):
            if ready.get(keys[k], at + 1) > at:
                ready[keys[k]] = at

    def claimed_tokens(self, item, in_flight: Sequence[tuple[float, int, int]],
                       replica: int) -> tuple[int, float]:
        """The longest part of `item`'s prompt that another replica is computing (its
        prefill not yet published), and when that one is published: (tokens, time)."""
        space, L = self.space, item.prompt_len
        mine = np.asarray(item.prompt_keys)[:space.max_match_keys(L)]
        best, until = 0, 0.0
        for end, j, r in in_flight:
            if r == replica:
                continue
            theirs = np.asarray(self.items[j].prompt_keys)[:len(mine)]
            same = mine[:len(theirs)] == theirs
            n = len(same) if same.all() else int(np.argmin(same))
            tokens = space.hit_tokens(n, n // space.tree_page_size,
                                      n % space.tree_page_size > 0, L)
            if tokens > best or (tokens == best and end < until):
                best, until = tokens, end
        return best, until

    def _held(self, run: _Run, item) -> int:
        space, L = self.space, item.prompt_len
        keys = run.cache.peek_prefix(item.prompt_keys, max_tokens=space.max_match_keys(L))
        return space.hit_tokens(keys, keys // space.tree_page_size,
                                keys % space.tree_page_size > 0, L)


def arrival_seconds(workload: Workload, seconds_per_unit: float) -> np.ndarray:
    """Arrival time of each request from the trace's start; all at 0 without timestamps."""
    stamps = [r.timestamp for r in workload.trace.requests]
    if any(t is None for t in stamps):
        return np.zeros(len(stamps))
    t = np.asarray(stamps, dtype=np.float64)
    return (t - t.min()) * seconds_per_unit


def output_tokens(workload: Workload) -> list[int]:
    """Decode length of each request for the service model (whether or not outputs are
    cached)."""
    out = []
    for r in workload.trace.requests:
        n = getattr(r, "output_length", None)
        if n is None and getattr(r, "output_ids", None) is not None:
            n = len(r.output_ids)
        out.append(n or 0)
    return out


def route_requests(workload: Workload) -> list[RouteRequest]:
    """The router's view of each request: its chained page keys (block-mode symbols)."""
    if workload.space.mode != "block":
        raise ValueError("the cluster and tier simulations run in block mode (--mode block)")
    return [RouteRequest(np.asarray(item.prompt_keys)[0::2].tolist(), item.prompt_len)
            for item in workload]


def simulate_cluster(workload: Workload, config: ClusterConfig,
                     requests: Sequence[RouteRequest] | None = None,
                     progress: Callable[[int], None] | None = None,
                     router: Router | None = None) -> ClusterStats:
    """Route and serve the whole workload once; every replica starts cold. `router`: a
    policy object to use instead of `config.router`'s (e.g. one that replays a served
    run's own choices)."""
    if requests is None:
        requests = route_requests(workload)
    cluster = _Replicas(workload, config)
    service = config.service
    if router is None:
        router = make_router(config.router, config.replicas,
                             capacity_pages=cluster.runs[0].mem.num_pages,
                             prefill_seconds_per_token=service.prefill_seconds_per_token,
                             cache_weight=config.cache_weight,
                             load_bound=config.load_bound, seed=config.seed,
                             load_fraction=config.share_load_fraction
                             if config.share_tokens else None)
    arrivals = arrival_seconds(workload, config.seconds_per_time_unit).tolist()
    outputs = output_tokens(workload)
    stats = ClusterStats(config.replicas, config.router, config.capacity_tokens, config.policy,
                         share_tokens=config.share_tokens)
    counts = [0] * config.replicas
    busy = [0.0] * config.replicas
    waits: list[float] = []
    ttfts: list[float] = []
    warmup = int(config.warmup_fraction * len(workload))
    start_clock = time.perf_counter()
    # (prefill end, request index, replica): published at its end; claimed until then
    published: list[tuple[float, int, int]] = []
    for i, item in enumerate(workload):
        now = arrivals[i]
        while published and published[0][0] <= now:
            cluster.store.serve(cluster.items[heapq.heappop(published)[1]])  # write-through
        cluster.now, cluster.item = now, item
        request = requests[i]
        r = router.choose(request, cluster)
        router.routed(request, r)
        shared = cluster.shared_tokens(request)
        hit = cluster.runs[r].serve(item)
        waited = 0.0
        if cluster.store is not None and hit is not None:
            claimed, until = cluster.claimed_tokens(item, published, r)
            if claimed > max(shared, hit):      # a peer computes more of it: wait, load
                shared = claimed
                waited = max(0.0, until - max(now, cluster.busy_until[r]))
        loaded = max(0, shared - hit) if hit is not None else 0
        computed = item.prompt_len - (hit or 0) - loaded
        seconds = service.seconds(computed, outputs[i]) + \
            loaded * service.prefill_seconds_per_token * config.share_load_fraction
        if cluster.store is not None and hit is not None:
            hit += loaded
        begin = max(now, cluster.busy_until[r]) + waited
        cluster.busy_until[r] = begin + seconds
        cluster.finishes[r].append(begin + seconds)
        if cluster.store is not None and hit is not None:
            prefill = seconds - service.seconds(0, outputs[i])
            heapq.heappush(published, (begin + prefill, i, r))
            cluster.mark_ready(r, item, begin + prefill)
        counts[r] += 1
        busy[r] += seconds
        if i >= warmup:
            stats.count(item.prompt_len, hit)
            stats.loaded_tokens += loaded
            waits.append(begin - now)
            ttfts.append(begin - now + computed * service.prefill_seconds_per_token)
        cluster.runs[r].after_request(i, progress)
    for run in cluster.runs + ([cluster.store] if cluster.store is not None else []):
        run.finish()
    stats.requests = len(workload)
    stats.replica_requests = counts
    stats.replica_busy_seconds = busy
    if waits:
        stats.wait_p50, stats.wait_p99 = np.percentile(waits, [50, 99]).tolist()
        stats.ttft_p50, stats.ttft_p99 = np.percentile(ttfts, [50, 99]).tolist()
    stats.seconds = time.perf_counter() - start_clock
    return stats
