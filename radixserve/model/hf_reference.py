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
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    path = resolve_short_name(model_arg) or Path(model_arg)
    if path.is_dir() and (path / "config.json").is_file():
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=loaded.dtype,
                                                 local_files_only=True)
    elif loaded.config.gemma:
        m = _gemma3_from_gguf(path, loaded)
    else:
        c = loaded.config
        hf_cfg = LlamaConfig(
            **_shape_kwargs(c),
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
        if c.rope_scaling is not None:
            raise SystemExit("transformers comparison for scaled-RoPE GGUFs is not wired up")
        m = LlamaForCausalLM(hf_cfg).to(loaded.dtype)
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


def _gemma3_from_gguf(path: Path, loaded):
    """transformers' Gemma 3 built from our reading of a GGUF's config, holding its
    dequantized weights (norms as transformers stores them: w, not llama.cpp's 1 + w)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    c = loaded.config
    hf_cfg = Gemma3TextConfig(
        **_shape_kwargs(c), sliding_window=max(w for w in c.windows if w is not None),
        layer_types=["full_attention" if w is None else "sliding_attention" for w in c.windows],
        query_pre_attn_scalar=int(c.query_pre_attn_scalar),
        final_logit_softcapping=c.final_logit_softcapping,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}})
    m = Gemma3ForCausalLM(hf_cfg).to(loaded.dtype)
    missing = m.load_state_dict(dict(load_gguf(path, loaded.dtype).weights),
                                strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    m.tie_weights()
    return m
