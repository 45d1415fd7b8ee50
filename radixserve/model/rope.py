"""Rotary position embedding: frequencies (with the config's scaling) and a cos/sin table.

The table is computed once up to max_position_embeddings and indexed by each token's
position, so a flat batch of unrelated sequences needs no per-sequence work.
Formulas follow transformers' `ROPE_INIT_FUNCTIONS` so logits match bit-for-bit in fp32.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2]."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64)
                                         .to(torch.float32) / d))
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin [max_pos, head_dim // 2] in the working dtype (as transformers casts
    them before multiplying) and applies the rotate-half rotation."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        inv_freq = inv_frequencies(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim // 2] for the tokens' positions (once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> rotated, same shape: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """apply_rotary written back into ``x`` with the same bits (the same products and sums,
    rounded in the same order), without the concatenated copy: ``x`` may be a view, so q
    and k of a fused projection rotate in one call."""
    x1, x2 = x.chunk(2, dim=-1)
    x1_sin, x2_sin = x1 * sin, x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
