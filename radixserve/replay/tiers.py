"""Tier simulation: a KV cache with host memory and disk below it (demote, then load).

The first tier is the replay's own cache (RadixCache + PagedMemory at `--capacity-tokens`),
unchanged: a page it evicts is *demoted* to the host tier, a page the host tier evicts goes
to disk, and one the disk evicts is gone. Host and disk are LRU sets of pages, named by
their chained block-mode symbol (a page and its whole prefix). A request whose prefix runs
on past what the first tier holds continues its match in host memory, then on disk: those
pages are *loaded* instead of recomputed (disk pages through host memory, where they stay).
Loaded pages enter the first tier as computed ones would, so the first tier behaves exactly
as in a plain replay; the lower tiers only add hits. Counts are in tokens and bytes
(`kv_bytes_per_token`, whole pages moved).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.cache.memory import PagedMemory

from .belady import PageAtATimeMemory
from .cluster import route_requests
from .replayer import ReplayConfig, _Run
from .workload import Workload

TIERS = ("host", "disk")


class _Demoting:
    """Memory that reports each page its allocations evict (block mode: by page symbol).

    Before an allocation that must evict, it notes the pages of the nodes that can lose
    pages: the first `short` evictable leaves in policy order and their unlocked ancestors
    (at most `short` leaves lose a page, and a node only becomes evictable once its
    children are gone). Afterwards a node that left the tree lost all its pages, a trimmed
    one its tail. The eviction itself is the base memory's, unchanged.
    """

    on_demote: Callable[[int], None]

    def alloc_after(self, head, n: int):
        short = n - self.num_free
        watched = self._watch(short) if short > 0 else []
        pages = super().alloc_after(head, n)
        for node, symbols in watched:
            kept = 0 if node.parent is None else len(node.pages)
            for symbol in symbols[kept:]:
                self.on_demote(symbol)
        return pages

    def _watch(self, short: int) -> list:
        seen: dict[int, tuple] = {}
        for k, leaf in enumerate(self.tree.iter_evictable()):
            if k == short:
                break
            node = leaf
            while node.depth and node.lock_ref == 0 and node.id not in seen:
                seen[node.id] = (node, node.tokens[0::2])   # [symbol, MARK] per page
                node = node.parent
        return list(seen.values())


class DemotingMemory(_Demoting, PagedMemory):
    def __init__(self, num_pages: int, tree, on_demote: Callable[[int], None]):
        super().__init__(num_pages, tree)
        self.on_demote = on_demote


class DemotingPageAtATimeMemory(_Demoting, PageAtATimeMemory):
    def __init__(self, num_pages: int, tree, on_demote: Callable[[int], None]):
        super().__init__(num_pages, tree)
        self.on_demote = on_demote


class LRUPages:
    """One lower tier: a set of page symbols, least recently used dropped when full."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, symbol: int) -> bool:
        return symbol in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def touch(self, symbol: int) -> None:
        self._pages.move_to_end(symbol)

    def add(self, symbol: int) -> tuple[bool, int | None]:
        """Store (or refresh) a page: (was it written, the page dropped to make room)."""
        if symbol in self._pages:
            self._pages.move_to_end(symbol)
            return False, None
        self._pages[symbol] = None
        if len(self._pages) > self.capacity_pages:
            return True, self._pages.popitem(last=False)[0]
        return True, None


@dataclass(frozen=True, slots=True)
class TierConfig:
    host_capacity_tokens: int = 0       # 0: no host tier
    disk_capacity_tokens: int = 0       # 0: no disk tier
    kv_bytes_per_token: int = 131072    # e.g. Llama-3-8B, fp16: 32 layers x 8 x 128 x 2 x 2

    def __post_init__(self):
        if self.host_capacity_tokens < 0 or self.disk_capacity_tokens < 0:
            raise ValueError("tier capacities must be >= 0 tokens")
        if self.kv_bytes_per_token < 1:
            raise ValueError("--kv-bytes-per-token must be >= 1")


@dataclass(slots=True)
class TierStats:
    """Hits split by the tier that served them, and the bytes that moved between tiers."""

    capacity_tokens: int
    policy: str
    host_capacity_tokens: int
    disk_capacity_tokens: int
    requests: int = 0
    measured_requests: int = 0
    query_tokens: int = 0
    unfit_requests: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0,
                                                                "disk": 0})
    # Bytes written into a tier (demotions, and disk -> host on a load) and read out of it
    # (loads towards the first tier, and host -> disk demotions).
    bytes_in: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_out: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    seconds: float = 0.0

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())

    def hit_rate(self, tier: str | None = None) -> float:
        n = self.total_hit_tokens if tier is None else self.hit_tokens[tier]
        return n / self.query_tokens if self.query_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "capacity_tokens": self.capacity_tokens, "policy": self.policy,
            "host_capacity_tokens": self.host_capacity_tokens,
            "disk_capacity_tokens": self.disk_capacity_tokens,
            "requests": self.requests, "measured_requests": self.measured_requests,
            "query_tokens": self.query_tokens, "unfit_requests": self.unfit_requests,
            "hit_tokens": dict(self.hit_tokens), "token_hit_rate": self.hit_rate(),
            "token_hit_rate_by_tier": {t: self.hit_rate(t) for t in self.hit_tokens},
            "prefill_tokens": self.query_tokens - self.total_hit_tokens,
            "bytes_in": dict(self.bytes_in), "bytes_out": dict(self.bytes_out),
            "seconds": self.seconds,
        }


class _Hierarchy:
    """The lower tiers, page moves between them, and the byte counts."""

    def __init__(self, config: TierConfig, page_size: int, stats: TierStats):
        self.tiers: list[tuple[str, LRUPages]] = []
        for name, cap in (("host", config.host_capacity_tokens),
                          ("disk", config.disk_capacity_tokens)):
            if cap // page_size:
                self.tiers.append((name, LRUPages(cap // page_size)))
        self.page_bytes = page_size * config.kv_bytes_per_token
        self.stats = stats
        self.counting = False           # byte counts start with the measured requests

    def demote(self, symbol: int, level: int = 0) -> None:
        """A page leaves the tier above `level` (the first tier for 0): store it here."""
        if level >= len(self.tiers):
            return
        name, tier = self.tiers[level]
        written, dropped = tier.add(symbol)
        if written and self.counting:
            self.stats.bytes_in[name] += self.page_bytes
            if level:
                self.stats.bytes_out[self.tiers[level - 1][0]] += self.page_bytes
        if dropped is not None:
            self.demote(dropped, level + 1)

    def where(self, symbol: int) -> int | None:
        """The highest lower tier holding the page, or None."""
        for level, (_, tier) in enumerate(self.tiers):
            if symbol in tier:
                return level
        return None

    def reserve(self, symbol: int, level: int) -> None:
        """A page the request will load: most recently used, so its own evictions keep it."""
        self.tiers[level][1].touch(symbol)

    def load(self, symbol: int, level: int) -> None:
        """Read the page up (through host memory, where a page from disk then stays)."""
        if self.counting:
            self.stats.bytes_out[self.tiers[level][0]] += self.page_bytes
        if level:                       # disk -> host -> first tier; it stays in host memory
            self.demote(symbol, 0)
            if self.counting:
                self.stats.bytes_out[self.tiers[0][0]] += self.page_bytes


def simulate_tiers(workload: Workload, config: ReplayConfig, tiers: TierConfig,
                   progress: Callable[[int], None] | None = None) -> TierStats:
    """Replay the workload on the first tier with host and disk tiers below it."""
    space = workload.space
    requests = route_requests(workload)            # block mode: each page's chained symbol
    stats = TierStats(config.capacity_tokens, config.policy, tiers.host_capacity_tokens,
                      tiers.disk_capacity_tokens)
    hierarchy = _Hierarchy(tiers, space.page_size, stats)

    def memory(num_pages, cache):
        page_at_a_time = getattr(cache.policy, "evicts_pages_one_at_a_time", False)
        kind = DemotingPageAtATimeMemory if page_at_a_time else DemotingMemory
        return kind(num_pages, cache, hierarchy.demote)

    run = _Run(workload, config, memory=memory)
    set_now = getattr(run.policy, "set_now", None)
    ps, pair = space.page_size, space.tree_page_size
    warmup = int(config.warmup_fraction * len(workload))
    start = time.perf_counter()
    for i, item in enumerate(workload):
        if set_now is not None:
            set_now(i)
        measured = i >= warmup
        hierarchy.counting = measured
        L = item.prompt_len
        keys = run.cache.peek_prefix(item.prompt_keys, max_tokens=space.max_match_keys(L))
        lower = []                               # (page, tier level, tokens) past tier 1
        if not keys % pair:                      # tier 1 did not end inside a capped page
            matchable = L - 1
            symbols = requests[i].page_keys
            for page in range(keys // pair, -(-matchable // ps)):
                level = hierarchy.where(symbols[page])
                if level is None:
                    break
                lower.append((symbols[page], level, min(ps, matchable - page * ps)))
        for symbol, level, _ in lower:
            hierarchy.reserve(symbol, level)
        hit = run.serve(item)
        if hit is not None:
            for symbol, level, _ in lower:
                hierarchy.load(symbol, level)
        if measured:
            stats.measured_requests += 1
            stats.query_tokens += L
            if hit is None:
                stats.unfit_requests += 1
            else:
                stats.hit_tokens["gpu"] += hit
                for _, level, tokens in lower:
                    stats.hit_tokens[hierarchy.tiers[level][0]] += tokens
        run.after_request(i, progress)
    run.finish()
    stats.requests = len(workload)
    stats.seconds = time.perf_counter() - start
    return stats


def tier_levels(stats: TierStats) -> list[str]:
    """The tiers a run had, top first: gpu, then host and disk where configured."""
    return ["gpu"] + [t for t, cap in (("host", stats.host_capacity_tokens),
                                       ("disk", stats.disk_capacity_tokens)) if cap]


