"""The tensors a Llama-family checkpoint must hold, in Hugging Face names and shapes.

Both loaders produce HF-named tensors; `check_weights` compares them against the config
before anything is copied, so a bad checkpoint fails with a sentence, not a torch error.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from .config import ModelConfig
from .errors import ModelLoadError

# Present in some checkpoints, never needed: we compute RoPE ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * d,)
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.gemma:       # norms after attention and around the MLP too
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (cfg.intermediate_size,)
            shapes[p + "mlp.up_proj.bias"] = (cfg.intermediate_size,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


def check_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor | tuple[int, ...]],
                  source: str) -> None:
    """Raise ModelLoadError naming missing, unexpected or mis-shaped tensors.
    `weights` maps names to tensors or bare shapes (so files can be checked before
    reading their data); a LazyWeights is checked by its shapes, without reading."""
    if cfg.mla is not None:          # DeepSeek (MLA): its own names
        from .deepseek_weights import deepseek_shapes
        return compare_weights(cfg, deepseek_shapes(cfg), weights, source)
    compare_weights(cfg, expected_shapes(cfg), weights, source)


def compare_weights(cfg: ModelConfig, expected: Mapping[str, tuple[int, ...]],
                    weights: Mapping[str, torch.Tensor | tuple[int, ...]], source: str) -> None:
    """check_weights against the given expected names and shapes."""
    if isinstance(weights, LazyWeights):
        weights = weights.shapes
    present = {k for k in weights if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")   # tied: a stored copy is redundant
    missing = sorted(expected.keys() - present)
    if missing:
        raise ModelLoadError(
            f"{source}: missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    unexpected = sorted(present - expected.keys())
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensor(s) for this architecture, e.g. "
            f"{', '.join(unexpected[:3])}")
    for name, shape in expected.items():
        w = weights[name]
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w)
        if got != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {got}, expected {shape} from the config")


class LazyWeights(Mapping[str, torch.Tensor]):
    """HF-named tensors produced on access (read, dequantized, cast), so that loading
    holds one layer's tensors at a time besides the model, never a second model copy.
    `shapes` is known up front, from file headers, for `check_weights`."""

    def __init__(self, shapes: dict[str, tuple[int, ...]],
                 read: Callable[[str], torch.Tensor]):
        self.shapes = shapes
        self._read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
