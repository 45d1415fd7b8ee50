"""TierRuntime: the engine's tiers below the KV pool, in one place.

It owns what the tiers are made of at run time: the tree's bookkeeping (`LowerTiers`), the
disk tier's pages (`TierPages`), the reader and writer threads, and the measured costs
that decide between loading a cached prefix and computing it again (`TierCosts`). The
engine asks it, and nothing below it, to load a match, to run a step's moves, to learn
from a step's timings (`observe`), for its stats, and to `close`. Built by
tier_setup.make_tiers; None in an engine without host/disk tiers.
"""

from __future__ import annotations

import asyncio
import time

from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.radix_cache import MatchResult
from radixserve.cache.tier_types import LOWER_TIERS, Move, Tier
from radixserve.cache.tiers import DemoteOrder, LoadOrder, LowerTiers
from radixserve.engine.batch import StepResult
from radixserve.engine.cache_stats import DroppedTokens, LowerTierStats, TierStats
from radixserve.engine.tier_costs import TierCosts
from radixserve.storage.disk_reader import DiskReader
from radixserve.storage.disk_writer import DiskWriter
from radixserve.storage.tier_pages import TierPages

__all__ = ["TierRuntime"]

HOST_LOAD = Move(Tier.HOST, Tier.POOL)


class TierRuntime:
    def __init__(self, lower: LowerTiers, costs: TierCosts, disk: TierPages | None = None,
                 reader: DiskReader | None = None, writer: DiskWriter | None = None):
        self.lower = lower
        self.costs = costs
        self.disk = disk
        self.reader = reader            # disk reads off the event loop (None: no disk tier)
        self.writer = writer            # page files written off the step
        self.page_size = lower.tree.page_size

    # ------------------------------------------------------------------ requests
    def load(self, lease: PrefixLease, match: MatchResult) -> None:
        """Bring the host/disk part of a fresh lease's match into the pool, as far as the
        costs say loading beats computing. Raises ReadPending (nothing changed) while its
        disk pages are being read on the reader's thread."""
        max_tier = self.costs.max_tier()
        if max_tier == Tier.POOL:
            return
        # Without a reader thread the disk reads happen in here (with one, `observe` takes
        # their timing from the reader); the runner times the copies.
        on_disk = (match.lower_tokens(Tier.DISK)
                   if max_tier >= Tier.DISK and self.reader is None else 0)
        started = time.perf_counter()
        lease.load(match, max_tier)
        if on_disk:
            self.costs.observe_load(Tier.DISK, on_disk, time.perf_counter() - started)

    # ------------------------------------------------------------------ the step
    def take_moves(self) -> list[DemoteOrder | LoadOrder]:
        """The orders issued since the last call, for the next step (in this order)."""
        return self.lower.take_moves()

    def moves_done(self) -> None:
        self.lower.moves_done()

    def observe(self, step: StepResult, batch_tokens: int) -> None:
        """Feed what a step's moves and forward pass took to the load-or-compute choice
        (disk loads are timed by the reader, or by `load` without one)."""
        moves = step.moves
        if HOST_LOAD in moves.tokens:
            self.costs.observe_load(Tier.HOST, moves.tokens[HOST_LOAD],
                                    moves.seconds[HOST_LOAD])
        if self.reader is not None:
            pages, seconds = self.reader.take_timing()
            if pages:
                self.costs.observe_load(Tier.DISK, pages * self.page_size, seconds)
        self.costs.observe_prefill(batch_tokens, step.forward_seconds)

    def drain_writes(self) -> None:
        """Block until every queued disk write is done (a worker thread: saves)."""
        if self.writer is not None and self.lower.pending_writes:
            self.writer.drain()

    def stats(self) -> TierStats:
        """For /cache/stats and /metrics: capacity, use and movement of each lower tier."""
        tiers, c = self.lower, self.lower.counters
        ps = self.page_size
        by_tier = {}
        for tier in LOWER_TIERS:
            flow = c[tier]
            by_tier[tier.label] = LowerTierStats(
                capacity_tokens=tiers.capacity_pages(tier) * ps,
                cached_tokens=tiers.used_pages(tier) * ps,
                demoted_tokens=flow.demoted_tokens, loaded_tokens=flow.loaded_tokens,
                bytes_in=flow.bytes_in, bytes_out=flow.bytes_out)
        dropped = DroppedTokens(**{t.label: c[t].dropped_tokens for t in Tier})
        return TierStats(corrupt_pages=c.corrupt_pages, dropped_tokens=dropped,
                         costs=self.costs.as_dict(),
                         pending_disk_writes=len(tiers.pending_writes),
                         failed_disk_writes=c.failed_writes, **by_tier)

    # ------------------------------------------------------------------ end
    async def close(self) -> None:
        """Queued pages written, reader stopped, their results applied, disk closed."""
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)
        if self.reader is not None:
            await asyncio.to_thread(self.reader.close)
        self.lower.collect_io()
        if self.disk is not None:
            self.disk.close()
