"""TierCosts: load a cached prefix from host/disk, or compute it again? Measured, not assumed.

Seconds per token, as exponential moving averages of what the engine saw: the forward pass
of steps that computed at least `MIN_PREFILL_TOKENS` tokens (prefill-shaped), and per tier
the time to bring pages into the pool (the disk reads done at admission plus the copies the
runner timed). A tier is loaded from while its load costs less per token than computing;
until both are measured it is loaded from (the first loads are how it gets measured).

A tier found slower is skipped, so nothing would measure it again: after `PROBE_AFTER_S`
of skipping, loads from it are let through until one is measured, and that sample replaces
the old figure (a disk that was slow for a minute is not skipped until a restart).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.cache.tier_types import LOWER_TIERS, Tier

MIN_PREFILL_TOKENS = 32
SMOOTHING = 0.2
PROBE_AFTER_S = 30.0        # a source skipped as slower than computing is tried again after this
PEER = "peer"               # the cluster store's key among the probed sources


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class TierCosts:
    prefill_s_per_token: float | None = None
    load_s_per_token: dict[Tier, float | None] = field(
        default_factory=lambda: {tier: None for tier in LOWER_TIERS})
    # --kv-share: fetching a peer's pages from the cluster store (engine/peer_share.py).
    peer_s_per_token: float | None = None
    clock: Callable[[], float] = time.monotonic
    # sources (a Tier, or PEER) found slower than computing, and since when
    _skipped_since: dict[object, float] = field(default_factory=dict)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_s_per_token = _blend(self.prefill_s_per_token, seconds / tokens)

    def observe_load(self, tier: Tier, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.load_s_per_token[tier] = self._sample(tier, self.load_s_per_token[tier],
                                                       seconds / tokens)

    def max_tier(self) -> Tier:
        """The lowest tier still worth loading from (POOL: load nothing, compute)."""
        best = Tier.POOL
        for tier in LOWER_TIERS:
            if not self._worth_loading(tier, self.load_s_per_token[tier]):
                break
            best = tier
        return best

    def _worth_loading(self, source: object, load: float | None) -> bool:
        """Cheaper per token than computing, not yet measured, or due a probe."""
        if load is None or self.prefill_s_per_token is None \
                or load < self.prefill_s_per_token:
            self._skipped_since.pop(source, None)
            return True
        now = self.clock()
        return now - self._skipped_since.setdefault(source, now) >= PROBE_AFTER_S

    def _sample(self, source: object, old: float | None, new: float) -> float:
        """A probe's sample (the source was being skipped) replaces the doubted figure."""
        if self._skipped_since.pop(source, None) is not None:
            return new
        return _blend(old, new)

    def observe_peer_load(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.peer_s_per_token = self._sample(PEER, self.peer_s_per_token, seconds / tokens)

    def peer_worth_loading(self) -> bool:
        """Load from the cluster store while it is cheaper per token than computing (or
        not yet measured: the first loads are how it gets measured; or due a probe)."""
        return self._worth_loading(PEER, self.peer_s_per_token)

    def as_dict(self) -> dict:
        return {"prefill_s_per_token": self.prefill_s_per_token,
                "load_s_per_token": {t.label: v for t, v in self.load_s_per_token.items()}}
