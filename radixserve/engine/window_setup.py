"""Whether a model's sliding-window layers get their own pool, and how big each pool is.

`--kv-window-pool auto` turns per-group pools on for a model with sliding-window layers
(Gemma 2/3, sliding Mistral/Qwen2/Qwen3). Layers of several window sizes share one windowed
pool kept at the largest window (each still attends within its own; docs/models.md says
why not one pool per size). Every other flag combines with the window pools (tiers, persistence,
flashinfer, deterministic mode, quantized KV: docs/models.md).
"""

from __future__ import annotations

import logging

from radixserve.engine.config import EngineConfig
from radixserve.kv_sizing import GroupPools, LayerGroup, window_pools

log = logging.getLogger(__name__)

def pool_window(config: EngineConfig, layer_windows: tuple[int | None, ...]) -> int | None:
    """The window the windowed pool keeps (the largest of the layers'), or None for one
    full-KV pool."""
    if config.kv_window_pool not in ("auto", "off"):
        raise ValueError(f"--kv-window-pool must be auto or off, got {config.kv_window_pool!r}")
    windows = sorted({w for w in layer_windows if w is not None})
    if config.kv_window_pool == "off" or not windows:
        return None
    if len(windows) > 1:
        log.info("KV pools: windows %s share one windowed pool kept at %d tokens (each layer "
                 "attends within its own window)", windows, windows[-1])
    return windows[-1]


def group_pools(config: EngineConfig, groups: list[LayerGroup], max_model_len: int,
                budget: float) -> GroupPools:
    """The per-group page counts (kv_sizing.window_pools, as `radixserve plan`)."""
    return window_pools(groups, page_size=config.page_size,
                        kv_cache_tokens=config.kv_cache_tokens, budget=budget,
                        max_model_len=config.max_model_len or max_model_len,
                        chunk_tokens=config.chunked_prefill_size,
                        fraction=config.kv_window_pool_fraction,
                        checkpoint=config.kv_window_checkpoint)
