"""The runner's KV side for latent-attention (MLA) models: a LatentKVPool and an MLA
backend in place of KVPool and the per-head backends, sized by the same arithmetic as
`radixserve plan` (layers x (kv_lora_rank + qk_rope_head_dim) x element bytes)."""

from __future__ import annotations

import torch

from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.mla_backend import MLABackend, create_mla_backend
from radixserve.engine.config import EngineConfig
from radixserve.kv_sizing import KVFormat
from radixserve.model.config import ModelConfig


def latent_token_bytes(mc: ModelConfig, kv_format: KVFormat) -> int:
    """Bytes one token's latents take across all layers (after the format check)."""
    return LatentKVPool.token_bytes(mc.num_layers, mc.mla.kv_lora_rank,
                                    mc.mla.qk_rope_head_dim, check_latent_format(kv_format))


def check_latent_format(kv_format: KVFormat) -> str:
    """The latents' element format: one for both sides (a latent is K and V at once)."""
    if kv_format.k != kv_format.v:
        raise ValueError(f"--kv-cache-dtype-k {kv_format.k} and --kv-cache-dtype-v "
                         f"{kv_format.v} differ: a latent-attention (MLA) model caches one "
                         f"latent per token, give one --kv-cache-dtype")
    return kv_format.k


def latent_attention(config: EngineConfig, mc: ModelConfig, num_pages: int,
                     dtype: torch.dtype, device: torch.device,
                     kv_format: KVFormat) -> tuple[LatentKVPool, MLABackend]:
    pool = LatentKVPool(mc.num_layers, num_pages, config.page_size, mc.mla.kv_lora_rank,
                        mc.mla.qk_rope_head_dim, dtype, device,
                        element=check_latent_format(kv_format))
    backend = create_mla_backend(config.attention_backend, num_heads=mc.num_heads,
                                 deterministic=config.deterministic)
    return pool, backend


def describe_latent_cache(pool: LatentKVPool) -> str:
    """The start-up line for latent pages."""
    scale = " and one float32 scale" if pool.quantized else ""
    return (f"kv cache: MLA latents, {pool.kv_lora_rank} + {pool.rope_dim} (RoPE key) "
            f"{pool.kv_format.k} values{scale} per token and layer, "
            f"{pool.bytes_per_token} bytes per token")
