"""The tensors a DeepSeek-V2/V3 checkpoint must hold, in Hugging Face names and shapes
(routed experts one by one, as `save_pretrained` and the released checkpoints store them).
"""

from __future__ import annotations

from .config import ModelConfig


def _mlp(shapes: dict, prefix: str, hidden: int, inter: int) -> None:
    shapes[prefix + "gate_proj.weight"] = (inter, hidden)
    shapes[prefix + "up_proj.weight"] = (inter, hidden)
    shapes[prefix + "down_proj.weight"] = (hidden, inter)


def deepseek_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    m, moe, h, heads = cfg.mla, cfg.moe, cfg.hidden_size, cfg.num_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if m.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (heads * m.qk_head_dim, h)
        else:
            shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, h)
            shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (m.latent_dim, h)
        shapes[a + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim),
                                          m.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (h, heads * m.v_head_dim)
        if moe is None or not moe.is_moe_layer(i):
            _mlp(shapes, p + "mlp.", h, cfg.intermediate_size)
            continue
        shapes[p + "mlp.gate.weight"] = (moe.num_experts, h)
        if moe.scoring == "sigmoid":
            shapes[p + "mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
        for e in range(moe.num_experts):
            _mlp(shapes, f"{p}mlp.experts.{e}.", h, moe.moe_intermediate_size)
        if moe.num_shared_experts:
            _mlp(shapes, p + "mlp.shared_experts.", h,
                 moe.moe_intermediate_size * moe.num_shared_experts)
    return shapes

