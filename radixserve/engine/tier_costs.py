"""TierCosts: load a cached prefix from host/disk, or compute it again? Measured, not assumed.

Seconds per token, as exponential moving averages of what the engine saw: the forward pass
of steps that computed at least `MIN_PREFILL_TOKENS` tokens (prefill-shaped), and per tier
the time to bring pages into the pool (the disk reads done at admission plus the copies the
runner timed). A tier is loaded from while its load costs less per token than computing;
until both are measured it is loaded from (the first loads are how it gets measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cache.tier_types import LOWER_TIERS, Tier

MIN_PREFILL_TOKENS = 32
SMOOTHING = 0.2


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class TierCosts:
    prefill_s_per_token: float | None = None
    load_s_per_token: dict[Tier, float | None] = field(
        default_factory=lambda: {tier: None for tier in LOWER_TIERS})

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_s_per_token = _blend(self.prefill_s_per_token, seconds / tokens)

    def observe_load(self, tier: Tier, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.load_s_per_token[tier] = _blend(self.load_s_per_token[tier], seconds / tokens)

    def max_tier(self) -> Tier:
        """The lowest tier still worth loading from (POOL: load nothing, compute)."""
        best = Tier.POOL
        for tier in LOWER_TIERS:
            load = self.load_s_per_token[tier]
            if load is not None and self.prefill_s_per_token is not None \
                    and load >= self.prefill_s_per_token:
                break
            best = tier
        return best

    # --kv-share: fetching a peer's pages from the cluster store (engine/peer_share.py).
    peer_s_per_token: float | None = None

    def observe_peer_load(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.peer_s_per_token = _blend(self.peer_s_per_token, seconds / tokens)

    def peer_worth_loading(self) -> bool:
        """Load from the cluster store while it is cheaper per token than computing (or
        not yet measured: the first loads are how it gets measured)."""
        return self.peer_s_per_token is None or self.prefill_s_per_token is None \
            or self.peer_s_per_token < self.prefill_s_per_token

    def as_dict(self) -> dict:
        return {"prefill_s_per_token": self.prefill_s_per_token,
                "load_s_per_token": {t.label: v for t, v in self.load_s_per_token.items()}}
