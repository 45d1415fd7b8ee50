"""Tier replay: the server's host and disk tiers below the replay's cache.

The first tier is the replay's own cache (RadixCache + PagedMemory at `--capacity-tokens`).
Below it runs the server's tier code, `LowerTiers` (cache/tiers.py), attached to the same
tree as the engine attaches it (engine/tier_setup.py), so replay's tier figures and the
server's come from one implementation. What the replay has no use for is simulated: there
is no KV data, so `ReplayDisk` only records which disk slots hold a written page, and the
orders the tiers issue are "run" after each request (a disk demotion marks its slots
written) before `moves_done` ends them, as the engine's step does.

Per request, as the engine admits one (engine/seq_memory.py, engine/tier_runtime.py):
match and lock the prefix, load its host/disk part into the pool (`PrefixLease.load`),
then grow and extend as in a plain replay. The engine loads while its measured costs say
loading beats computing; the replay always loads (it counts hits, not seconds). Hits are
split by the tier that served them; bytes are `LowerTiers`' own counters over the measured
requests, whole pages of `--kv-bytes-per-token` x page size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.radix_cache import MatchResult
from radixserve.cache.tier_types import LOWER_TIERS, Tier
from radixserve.cache.tiers import DemoteOrder, LoadOrder, LowerTiers

from .replayer import ReplayConfig, _Run
from .workload import KeySpace, Workload

TIERS = ("host", "disk")
_NAMES = {Tier.POOL: "gpu", Tier.HOST: "host", Tier.DISK: "disk"}    # the report's names


class ReplayDisk:
    """The disk tier's page store without bytes: the disk slots whose page was written. A
    read of any other slot fails, as a missing file would."""

    def __init__(self) -> None:
        self.written: set[int] = set()

    def write_page(self, slot: int) -> None:
        self.written.add(slot)

    def read_page(self, slot: int) -> bytes | None:
        return b"" if slot in self.written else None

    def drop_page(self, slot: int) -> None:
        self.written.discard(slot)

    def run(self, orders: Sequence[DemoteOrder | LoadOrder]) -> None:
        """What the engine's runner does with a step's tier orders, in issue order, minus
        the bytes: the pages they demote to disk are written."""
        for order in orders:
            if isinstance(order, DemoteOrder) and order.dst_tier == Tier.DISK:
                for slot in order.dst.tolist():
                    self.write_page(slot)


def run_orders(lower: LowerTiers, disk: ReplayDisk) -> None:
    """The queued orders run (as at the engine's next step), then they are done."""
    disk.run(lower.take_moves())
    lower.moves_done()


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
class TierReplayStats:
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
    # Bytes written into a tier (demotions) and read out of it (loads into the first tier,
    # and host -> disk demotions): LowerTiers' counters.
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


class _Loader:
    """Loads a match's host/disk part at admission and notes what each tier served."""

    def __init__(self, lower: LowerTiers, space: KeySpace):
        self.lower = lower
        self.space = space                      # block mode: a page is 2 keys
        self.served: dict[Tier, int] = {}       # the last admission's loaded tokens by tier

    def __call__(self, lease: PrefixLease, match: MatchResult) -> int:
        flows = self.lower.counters.flows
        before = {t: flows[t].loaded_tokens for t in LOWER_TIERS}
        lease.load(match, Tier.DISK)
        space = self.space      # loads are whole pages: keys -> pages -> tokens
        self.served = {t: (flows[t].loaded_tokens - before[t]) // space.tree_page_size
                       * space.page_size for t in LOWER_TIERS}
        return sum(self.served.values())


def simulate_tiers(workload: Workload, config: ReplayConfig, tiers: TierConfig,
                   progress: Callable[[int], None] | None = None) -> TierReplayStats:
    """Replay the workload on the first tier with the server's host and disk tiers below."""
    space = workload.space
    ps = space.page_size
    stats = TierReplayStats(config.capacity_tokens, config.policy, tiers.host_capacity_tokens,
                            tiers.disk_capacity_tokens)
    run = _Run(workload, config)
    disk = ReplayDisk()
    disk_pages = tiers.disk_capacity_tokens // ps
    lower = LowerTiers(run.cache, run.mem.num_pages, tiers.host_capacity_tokens // ps,
                       disk_pages, disk if disk_pages else None,
                       page_bytes=ps * tiers.kv_bytes_per_token)
    loader = run.load = _Loader(lower, space)
    set_now = getattr(run.policy, "set_now", None)
    warmup = int(config.warmup_fraction * len(workload))
    flows = lower.counters.flows
    at_warmup = {t: (0, 0) for t in LOWER_TIERS}
    start = time.perf_counter()
    for i, item in enumerate(workload):
        if set_now is not None:
            set_now(i)
        measured = i >= warmup
        if i == warmup:
            at_warmup = {t: (flows[t].bytes_in, flows[t].bytes_out) for t in LOWER_TIERS}
        loader.served = {}
        hit = run.serve(item)
        run_orders(lower, disk)
        if measured:
            stats.measured_requests += 1
            stats.query_tokens += item.prompt_len
            if hit is None:
                stats.unfit_requests += 1
            else:
                served = sum(loader.served.values())
                stats.hit_tokens["gpu"] += hit - served
                for tier, tokens in loader.served.items():
                    stats.hit_tokens[_NAMES[tier]] += tokens
        run.after_request(i, progress)
    run.finish()
    run_orders(lower, disk)
    for tier in LOWER_TIERS:
        start_in, start_out = at_warmup[tier]
        stats.bytes_in[_NAMES[tier]] = flows[tier].bytes_in - start_in
        stats.bytes_out[_NAMES[tier]] = flows[tier].bytes_out - start_out
    stats.requests = len(workload)
    stats.seconds = time.perf_counter() - start
    return stats


def tier_levels(stats: TierReplayStats) -> list[str]:
    """The tiers a run had, top first: gpu, then host and disk where configured."""
    return ["gpu"] + [t for t, cap in (("host", stats.host_capacity_tokens),
                                       ("disk", stats.disk_capacity_tokens)) if cap]
