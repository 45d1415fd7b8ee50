"""Tiny random-weight DeepSeek-V2/V3 checkpoints (MLA, with and without MoE), saved as
transformers directories, with our loaded model beside transformers' own."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_models import Family
from tiny_models import byte_level_vocab, random_hf_model, save_hf_dir

# Widths all distinct (latent 32, rope 8, nope 16, v 12, 4 heads), so a test can tell
# per-head K/V tensors from latent ones by shape.
_BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
             max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2)

CONFIGS: dict[str, tuple[str, dict]] = {
    # V3 with MoE: q low-rank, sigmoid group-limited router with a score bias, a dense
    # first layer, YaRN RoPE with mscale (in the softmax scale too).
    "v3-moe": ("deepseek_v3", dict(
        q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # V2-Lite-shaped without MoE: q in one projection, every layer dense.
    "v2-dense": ("deepseek_v2", dict(q_lora_rank=None,
                                     first_k_dense_replace=3)),
    # V2 with MoE: softmax greedy router, shared experts.
    "v2-moe": ("deepseek_v2", dict(q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2,
                                   n_shared_experts=2, first_k_dense_replace=1,
                                   topk_method="greedy")),
}


def deepseek_config(arch: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config
    vocab = len(byte_level_vocab()[0])
    cls = DeepseekV3Config if arch == "deepseek_v3" else DeepseekV2Config
    return cls(**{**_BASE, "vocab_size": vocab, "bos_token_id": vocab - 2,
                  "eos_token_id": vocab - 1, "pad_token_id": None, **overrides})


def build_mla_model(name: str, root: Path, seed: int = 0) -> Family:
    """Our loaded model (fp32) beside transformers' on the same saved weights."""
    from radixserve.model.loader import load_model
    arch, overrides = CONFIGS[name]
    hf = random_hf_model(deepseek_config(arch, **overrides), seed=seed)
    with torch.no_grad():                      # a bias that changes routing decisions
        for layer in hf.model.layers:
            router = getattr(layer.mlp, "gate", None)
            if router is not None and hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.normal_(0, 0.3)
    directory = save_hf_dir(root / name, hf)
    return Family(name, directory, hf, load_model(str(directory), dtype="float32"))
