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
    """The latents' dtype; 8-bit formats are refused (not yet checked for quality)."""
    if kv_format.k != kv_format.v or kv_format.k not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--kv-cache-dtype {kv_format.describe()} is not supported for "
                         f"latent-attention (MLA) models yet: latents are stored in the "
                         f"model's dtype (leave --kv-cache-dtype auto)")
    return kv_format.k


def latent_attention(config: EngineConfig, mc: ModelConfig, num_pages: int,
                     dtype: torch.dtype, device: torch.device,
                     kv_format: KVFormat) -> tuple[LatentKVPool, MLABackend]:
    pool = LatentKVPool(mc.num_layers, num_pages, config.page_size, mc.mla.kv_lora_rank,
                        mc.mla.qk_rope_head_dim, check_latent_format(kv_format), device)
    backend = create_mla_backend(config.attention_backend, num_heads=mc.num_heads,
                                 kv_lora_rank=mc.mla.kv_lora_rank,
                                 rope_dim=mc.mla.qk_rope_head_dim, dtype=dtype, device=device,
                                 deterministic=config.deterministic)
    return pool, backend


def describe_latent_cache(pool: LatentKVPool) -> str:
    """The start-up line for latent pages."""
    return (f"kv cache: MLA latents, {pool.kv_lora_rank} + {pool.rope_dim} (RoPE key) "
            f"{str(pool.dtype).removeprefix('torch.')} values per token and layer, "
            f"{pool.bytes_per_token} bytes per token")
