"""Typed stats of the prefix cache, the tiers below it and the disk store.

The engine fills these (EngineStats.cache / .tiers / .kv_disk); the routes and metrics read
their fields; `as_dict()` is the JSON `/cache/stats` returns, key for key in field order
(tests pin its shape).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

__all__ = ["CacheStats", "DiskStats", "DroppedTokens", "LowerTierStats", "TierStats"]


@dataclass
class CacheStats:
    """The radix tree's counters (tokens in the KV pool) and the prefix lookups."""

    cached_tokens: int = 0
    evictable_tokens: int = 0
    locked_tokens: int = 0
    nodes: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    enabled: bool = True

    def as_dict(self) -> dict:
        return asdict(self)

    def merged(self, other: CacheStats) -> CacheStats:
        """Two replicas' stats as one: counts summed, `enabled` only if both are."""
        out = CacheStats()
        for f in fields(CacheStats):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, (a and b) if isinstance(a, bool) else a + b)
        return out


@dataclass
class LowerTierStats:
    """One tier below the pool (host memory, disk): its size, use and movement."""

    capacity_tokens: int = 0
    cached_tokens: int = 0
    demoted_tokens: int = 0
    loaded_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class DroppedTokens:
    """Tokens dropped from each tier, by its label: `l1` evicted pool pages no lower tier
    took, `l2`/`l3` host/disk pages pushed out with no room below."""

    l1: int = 0
    l2: int = 0
    l3: int = 0


@dataclass
class TierStats:
    """The host/disk tiers (engine/tier_runtime.py): `l2` host memory, `l3` disk."""

    corrupt_pages: int = 0
    dropped_tokens: DroppedTokens = field(default_factory=DroppedTokens)
    costs: dict = field(default_factory=dict)       # TierCosts.as_dict()
    pending_disk_writes: int = 0
    failed_disk_writes: int = 0
    l2: LowerTierStats = field(default_factory=LowerTierStats)
    l3: LowerTierStats = field(default_factory=LowerTierStats)

    def tier(self, label: str) -> LowerTierStats:
        """A lower tier by its label, "l2" or "l3"."""
        return {"l2": self.l2, "l3": self.l3}[label]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DiskStats:
    """The store of --kv-disk-dir (engine/kv_persistence.py)."""

    dir: str
    used_bytes: int
    capacity_bytes: int | None
    pages: int
    corrupt_pages: int
    stale_pages: int
    faults: dict[str, int]          # disk faults absorbed, by kind (storage/disk_faults.py)
    skipped_writes: int             # page writes not tried while writes were paused
    writes_paused: str | None       # the fault kind that paused writes, None when writing
    restored_tokens: int
    saves: int
    last_save: dict | None          # SaveReport.as_dict() of the last save
    # What the start recovered (storage/disk_store.py: Recovery, plus the restore into
    # the tree) and the journal since (storage/journal.py).
    recovery: dict | None = None
    journal_records: int = 0        # appended by this server
    journal_bytes: int = 0          # in the journal files since the last index write
    compactions: int = 0            # journal folded into the index because it grew

    def as_dict(self) -> dict:
        return asdict(self)
