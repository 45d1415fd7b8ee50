"""The transformers implementation of a loaded model, on the same weights and dtype.

The reference our model is checked and benchmarked against (scripts/bench_model.py,
scripts/bench_engine.py). Imports transformers lazily: serving never needs it.
"""

from __future__ import annotations

from pathlib import Path

from radixserve.model.gguf_loader import load_gguf
from radixserve.model.registry import resolve_short_name


def hf_model_for(model_arg: str, loaded):
    """transformers' model with our weights and dtype."""
    from transformers import AutoModelForCausalLM
    path = resolve_short_name(model_arg) or Path(model_arg)
    if path.is_dir() and (path / "config.json").is_file():
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=loaded.dtype,
                                                 local_files_only=True)
    else:
        m = AutoModelForCausalLM.from_config(_hf_config(loaded.config)).to(loaded.dtype)
        missing = m.load_state_dict(dict(load_gguf(path, loaded.dtype).weights),
                                    strict=False).missing_keys
        assert set(missing) <= {"lm_head.weight"}, missing
        m.tie_weights()
    m.generation_config.eos_token_id = None
    return m.to(loaded.dtype).eval()


def _shape_kwargs(c) -> dict:
    """The transformers config arguments every family shares, from our ModelConfig."""
    return dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                max_position_embeddings=c.max_position_embeddings,
                tie_word_embeddings=c.tie_word_embeddings)


def _hf_config(c):
    """transformers' config of our reading of a GGUF (the families GGUF files carry)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              Qwen2Config, Qwen3Config)
    if c.rope_scaling is not None:
        raise SystemExit("transformers comparison for scaled-RoPE GGUFs is not wired up")
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    window = max((w for w in c.windows if w is not None), default=None)
    layer_types = ["full_attention" if w is None else "sliding_attention" for w in c.windows]
    scalar = c.query_pre_attn_scalar       # transformers types it int (256, 144...)
    scalar = int(scalar) if scalar is not None and scalar == int(scalar) else scalar
    if c.model_type == "gemma3_text":
        return Gemma3TextConfig(
            **_shape_kwargs(c), sliding_window=window, layer_types=layer_types,
            query_pre_attn_scalar=scalar,
            final_logit_softcapping=c.final_logit_softcapping,
            attn_logit_softcapping=c.attn_logit_softcapping,
            rope_parameters={"full_attention": rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": c.rope_local_theta}})
    if c.model_type == "gemma2":
        return Gemma2Config(
            **_shape_kwargs(c), sliding_window=window, layer_types=layer_types,
            query_pre_attn_scalar=scalar,
            final_logit_softcapping=c.final_logit_softcapping,
            attn_logit_softcapping=c.attn_logit_softcapping, rope_parameters=rope)
    if c.model_type in ("qwen2", "qwen3"):      # GGUF: full attention in every layer
        return (Qwen2Config if c.model_type == "qwen2" else Qwen3Config)(
            **_shape_kwargs(c), rope_parameters=rope)
    if window is not None:                      # llama arch with a window: Mistral
        return MistralConfig(**_shape_kwargs(c), sliding_window=window, rope_parameters=rope)
    return LlamaConfig(**_shape_kwargs(c), rope_parameters=rope)
