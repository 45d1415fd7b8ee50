"""Building the host/disk tiers of an engine from its config, and their stats.

The cache's bookkeeping (cache/tiers.py: LowerTiers) and the runner's data (host slots,
the disk writer: attention/kv_tiers.py) are sized here from the same page size in bytes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from radixserve.attention.page_bytes import page_payload_bytes
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers import DISK, HOST, TIER_NAMES, LowerTiers
from radixserve.engine.compute_thread import on_compute_thread
from radixserve.engine.config import DEFAULT_KV_DISK_BYTES, EngineConfig
from radixserve.engine.tier_costs import TierCosts

log = logging.getLogger(__name__)

TIER_SUBDIR = "tier"


def tier_pages(tokens: int | None, nbytes: int | None, page_size: int, page_bytes: int) -> int:
    """Pages of a tier sized in tokens or in bytes (0: no tier)."""
    if tokens:
        return tokens // page_size
    if nbytes:
        return nbytes // page_bytes
    return 0


def make_tiers(config: EngineConfig, runner, tree: RadixCache,
               disk_ok: bool) -> LowerTiers | None:
    """The engine's LowerTiers (None when no tier is configured or the cache is off); the
    runner gets the host slots and the disk writer. `disk_ok`: --kv-disk-dir was accepted
    (by the persistence, which opened it first); a refused directory is left untouched."""
    if config.disable_radix_cache:
        return None
    ps = config.page_size
    page_bytes = page_payload_bytes(runner.kv_pool)
    host_pages = tier_pages(config.kv_host_tokens, config.kv_host_bytes, ps, page_bytes)
    disk_pages, store = 0, None
    if config.kv_disk_dir and disk_ok:
        store, disk_pages = open_disk_tier(config, runner, page_bytes)
    if not host_pages and not disk_pages:
        return None
    on_compute_thread(runner.attach_tiers, host_pages, store)
    log.info("KV tiers: host %d tokens (%.1f MiB), disk %d tokens (%.1f MiB)",
             host_pages * ps, host_pages * page_bytes / 2**20, disk_pages * ps,
             disk_pages * page_bytes / 2**20)
    return LowerTiers(tree, runner.num_pages, host_pages, disk_pages, store, page_bytes)


def open_disk_tier(config: EngineConfig, runner, page_bytes: int):
    """(page store, pages) of the disk tier: its own store in --kv-disk-dir/tier (its own
    keys and budget; no index: what it holds does not outlive the process -- the saved
    cache beside it does)."""
    from radixserve.engine.kv_persistence import engine_fingerprint
    from radixserve.storage import DiskPageStore
    from radixserve.storage.checked_blob import HEADER

    capacity = config.kv_disk_bytes or DEFAULT_KV_DISK_BYTES
    store = DiskPageStore(Path(config.kv_disk_dir) / TIER_SUBDIR,
                          engine_fingerprint(config, runner), capacity)
    if not store.usable:
        return None, 0
    return store, capacity // (page_bytes + HEADER.size)


def tier_stats(tiers: LowerTiers, costs: TierCosts) -> dict:
    """For /cache/stats and /metrics: capacity, use and movement of each lower tier."""
    c = tiers.counters
    out = {"corrupt_pages": c.corrupt_pages, "dropped_tokens": dict(c.dropped_tokens),
           "costs": costs.as_dict(), "pending_disk_writes": len(tiers.pending_writes)}
    ps = tiers.tree.page_size
    for tier in (HOST, DISK):
        name = TIER_NAMES[tier]
        out[name] = {"capacity_tokens": tiers.capacity_pages(tier) * ps,
                     "cached_tokens": tiers.used_pages(tier) * ps,
                     "demoted_tokens": c.demoted_tokens[name],
                     "loaded_tokens": c.loaded_tokens[name],
                     "bytes_in": c.bytes_in[name], "bytes_out": c.bytes_out[name]}
    return out
