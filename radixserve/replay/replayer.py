"""Drive the real RadixCache + PagedMemory with a trace and count what the cache saves.

Per request, in replay order, through the server's own PrefixLease (cache/prefix_lease.py):
acquire (match at most L-1 tokens: the last prompt token is always computed, and lock the
match) -> grow by the pages for the rest of the request (PagedMemory evicts unlocked leaves
in policy order) -> extend by the prompt's whole pages (as after prefill) -> the request
stays in flight, holding its lease, until ``concurrency`` newer requests have arrived -> on
completion extend by prompt + output (``--include-outputs``) and release the lease.
A request that cannot fit even with everything else evicted counts as a miss.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


from radixserve.cache.memory import PagedMemory
from radixserve.cache.miss_reasons import SeenPrefixes, explain
from radixserve.cache.page_allocator import OutOfPages
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.radix_cache import MatchResult, RadixCache
from radixserve.cache.window_lease import WindowedLease, new_lease

from .belady import PageAtATimeMemory, make_policy
from .workload import ReplayItem, Workload

@dataclass(frozen=True, slots=True)
class ReplayConfig:
    capacity_tokens: int | None     # None: unbounded (the ceiling)
    policy: str = "lru"             # a cache policy name, or "belady"
    concurrency: int = 1            # requests in flight holding their locks
    warmup_fraction: float = 0.0    # leading share of requests left out of the rates
    check_every: int = 0            # run the conservation checks every N requests (tests)
    miss_reasons: bool = False      # count each request's miss reason (cache/miss_reasons.py)

    def __post_init__(self):
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError("warmup fraction must be in [0, 1)")
        if self.capacity_tokens is not None and self.capacity_tokens < 0:
            raise ValueError("capacity must be >= 0 tokens")


class HitCounts:
    """Rates from the counts a stats object keeps over its measured requests."""

    __slots__ = ()
    measured_requests: int
    query_tokens: int
    hit_tokens: int
    hit_requests: int
    unfit_requests: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.measured_requests if self.measured_requests else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that still had to be computed."""
        return self.query_tokens - self.hit_tokens

    def count(self, prompt_len: int, hit: int | None) -> None:
        """One measured request: its prompt length and hit tokens (None: it did not fit)."""
        self.measured_requests += 1
        self.query_tokens += prompt_len
        if hit is None:
            self.unfit_requests += 1
        elif hit:
            self.hit_tokens += hit
            self.hit_requests += 1


@dataclass(slots=True)
class ReplayStats(HitCounts):
    """Counts over the measured requests (those after the warm-up)."""

    policy: str
    capacity_tokens: int | None
    num_pages: int
    mode: str
    page_size: int
    concurrency: int
    requests: int = 0            # all replayed requests
    measured_requests: int = 0
    query_tokens: int = 0        # prompt tokens of measured requests
    hit_tokens: int = 0          # of them, served from the cache (prefill saved)
    hit_requests: int = 0        # measured requests with any hit
    unfit_requests: int = 0      # measured requests too big for the capacity (misses)
    seconds: float = 0.0
    miss_reasons: dict[str, int] = field(default_factory=dict)   # measured requests by reason

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(token_hit_rate=self.token_hit_rate,
                   request_hit_rate=self.request_hit_rate,
                   prefill_tokens_saved=self.hit_tokens,
                   prefill_tokens=self.prefill_tokens)
        return out


@dataclass(slots=True)
class _InFlight:
    item: ReplayItem
    lease: PrefixLease         # its locked prefix and private pages (as in the server)


class _Run:
    """State of one replay: a fresh cache and page pool, and the requests in flight."""

    def __init__(self, workload: Workload, config: ReplayConfig,
                 memory: Callable[[int, RadixCache], PagedMemory] | None = None):
        space = workload.space
        self.space = space
        self.config = config
        if config.capacity_tokens is None:
            num_pages = workload.page_demand()
        else:
            num_pages = config.capacity_tokens // space.page_size
        self.policy = make_policy(config.policy, workload, num_pages)
        self.cache = RadixCache(page_size=space.tree_page_size, policy=self.policy)
        if memory is None:
            memory = (PageAtATimeMemory
                      if getattr(self.policy, "evicts_pages_one_at_a_time", False)
                      else PagedMemory)
        self.mem = memory(num_pages, self.cache)
        self.inflight: deque[_InFlight] = deque()
        self.seen = SeenPrefixes(chunk=space.tree_page_size) if config.miss_reasons else None
        self.last_reason: str | None = None
        # Lower tiers (tiers.py): loads a fresh lease's host/disk match part into the pool
        # and returns the prompt tokens that served; None: no tiers below the cache.
        self.load: Callable[[PrefixLease, MatchResult], int] | None = None

    def explain(self, item: ReplayItem) -> None:
        """Where the request's prompt stops matching and why, as the server reports it."""
        chain = self.seen.chain(item.prompt_keys, None)
        self.last_reason = explain(self.cache, item.prompt_keys, None, self.seen, chain).reason.value
        self.seen.add(chain)

    def admit(self, item: ReplayItem) -> int | None:
        """Run one request's admission; its hit tokens, or None when it cannot fit."""
        space = self.space
        L = item.prompt_len
        if self.seen is not None:
            self.explain(item)
        lease = new_lease(self.mem)     # a WindowedLease over window pools (--model-layout)
        match = lease.acquire(item.prompt_keys, max_tokens=space.max_match_keys(L))
        hit = space.hit_tokens(match.matched_tokens, len(match.pages), match.cow_tokens > 0, L)
        if match.lower and self.load is not None:
            hit += self.load(lease, match)
        need = math.ceil((L + item.output_len) / space.page_size) - len(lease.pages)
        if not self._grow(lease, need):
            lease.release()
            return None
        lease.take_copy_orders()               # no KV data here: nothing to copy
        lease.extend(item.prompt_keys, space.keys_for_pages(L // space.page_size))
        self.inflight.append(_InFlight(item, lease))
        return hit

    def _grow(self, lease: PrefixLease, n: int) -> bool:
        """n more pages, completing the oldest requests in flight while memory is short."""
        while True:
            try:
                lease.grow(n)
                return True
            except OutOfPages:
                if not self.inflight:
                    return False
                self.complete(self.inflight.popleft())

    def complete(self, flight: _InFlight) -> None:
        """The request finished: insert prompt + output, unlock, free what is left."""
        item = flight.item
        if item.full_keys is None and isinstance(flight.lease, WindowedLease):
            # A window-aware lease kept its last window private: its end is a match point.
            pages = item.prompt_len // self.space.page_size
            flight.lease.release(item.prompt_keys, self.space.keys_for_pages(pages))
        elif item.full_keys is None:
            flight.lease.release()
        else:
            total = (item.prompt_len + item.output_len) // self.space.page_size
            flight.lease.release(item.full_keys, self.space.keys_for_pages(total))

    def serve(self, item: ReplayItem) -> int | None:
        """One request as the replay runs it: complete the oldest requests in flight down to
        concurrency - 1, then admit it. Its hit tokens, or None when it cannot fit."""
        while len(self.inflight) >= self.config.concurrency:
            self.complete(self.inflight.popleft())
        return self.admit(item)

    def drain(self) -> None:
        while self.inflight:
            self.complete(self.inflight.popleft())

    def after_request(self, index: int, progress: Callable[[int], None] | None) -> None:
        """Bookkeeping after request `index`: the periodic checks and the progress bar."""
        every = self.config.check_every
        if every and (index + 1) % every == 0:
            self.check()
        if progress is not None:
            progress(1)

    def finish(self) -> None:
        """Complete every request in flight (and check, when checks are on)."""
        self.drain()
        if self.config.check_every:
            self.check()

    def check(self) -> None:
        self.cache.check_invariants()
        self.mem.check_conservation([f.lease.private_pages for f in self.inflight])


def replay(workload: Workload, config: ReplayConfig,
           progress: Callable[[int], None] | None = None,
           memory: Callable[[int, RadixCache], PagedMemory] | None = None) -> ReplayStats:
    """Replay the whole workload once; the cache, page pool and policy are fresh
    (`memory`: the page accounting, e.g. window pools; default PagedMemory)."""
    space = workload.space
    run = _Run(workload, config, memory)
    stats = ReplayStats(config.policy, config.capacity_tokens, run.mem.num_pages,
                        space.mode, space.page_size, config.concurrency)
    warmup = int(config.warmup_fraction * len(workload))
    set_now = getattr(run.policy, "set_now", None)
    start = time.perf_counter()
    for i, item in enumerate(workload):
        if set_now is not None:
            set_now(i)
        hit = run.serve(item)
        if i >= warmup:
            stats.count(item.prompt_len, hit)
            if run.last_reason is not None:
                stats.miss_reasons[run.last_reason] = stats.miss_reasons.get(run.last_reason, 0) + 1
        run.after_request(i, progress)
    run.finish()
    stats.requests = len(workload)
    stats.seconds = time.perf_counter() - start
    return stats
