"""What the engine streams back for a request: deltas, then a final event with usage."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from radixserve.engine.cache_stats import CacheStats, DiskStats, TierStats


@dataclass
class GrammarMaskStats:
    """The sampler's grammar masks (engine/grammar_mask.py: GrammarMasks), cumulative."""

    steps: int = 0          # steps with at least one constrained row
    rows: int = 0           # constrained rows masked, all steps
    seconds: float = 0.0    # filling + applying the masks, all steps

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob), best first; len == params.logprobs


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int             # prompt tokens served from the prefix cache
    miss: Any = None               # cache.miss_reasons.MissReport: where the match stopped, why


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    index: int                     # which of the n samples
    token_ids: list[int]           # new tokens since this sample's previous event
    text: str                      # new text since this sample's previous event
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None     # set on the final event of each sample
    stop_reason: str | int | None = None   # the stop string or token id that matched
    arrival_time: float = 0.0      # time.monotonic() of the request's arrival
    first_token_time: float | None = None
    time: float = 0.0              # time.monotonic() when this event was produced
    cached_tokens: int | None = None   # prompt tokens served from the cache (known from the
                                       # first event on, so a stream can report it first)


@dataclass
class EngineStats:
    """Cumulative counters and current gauges, read by /metrics and /cache/stats."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    preemptions: int = 0
    recompute_hit_tokens: int = 0  # cache hits of sequences re-admitted after preemption
    evicted_tokens: int = 0
    steps: int = 0
    running: int = 0               # requests with a sample running (not samples)
    waiting: int = 0               # requests with a sample waiting
    pages_total: int = 0
    pages_free: int = 0
    pages_cached: int = 0          # held by the tree
    pages_locked: int = 0          # tree pages locked by running requests
    pages_private: int = 0         # held by live requests, not in the tree
    page_size: int = 1
    kv_pool_bytes: int = 0
    pinned_tokens: int = 0         # tokens of the pinned prefixes (engine/pins.py), summed
    pinned_prefixes: int = 0
    pinned_tokens_limit: int = 0   # --max-pinned-tokens in effect
    cache: CacheStats | None = None     # RadixCache counters (None: not filled in yet)
    tiers: TierStats | None = None      # host/disk tiers (TierRuntime.stats); None: none
    kv_disk: DiskStats | None = None    # --kv-disk-dir: KVPersistence.stats() (corrupt pages, saves)
    grammar_masks: GrammarMaskStats = field(default_factory=lambda: GrammarMaskStats())
    kv_events: object | None = None     # --kv-events: the publisher's PublisherStats; None: off
    share: object | None = None         # --kv-share: PeerShare's ShareStats; None: off


class OneProcessStats:
    """The engine-client stats hooks of an engine that lives in this process: no replicas,
    nothing to fetch first, no extra metrics (the Ray client has all three)."""

    def replica_stats(self) -> dict[str, EngineStats]:
        return {}

    async def refresh_stats(self) -> None:
        return None

    def metrics_collector(self) -> None:
        return None
