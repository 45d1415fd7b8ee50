"""DeepSeek's decoupled RoPE key: frequencies over qk_rope_head_dim (YaRN-scaled when the
config says so) and the pairwise rotation.

Formulas follow transformers' `_compute_yarn_parameters` so logits match in fp32. YaRN's
`attention_factor` scales cos/sin (so q_pe.k_pe carries it squared); the softmax scale's
own mscale factor is `MLAConfig.softmax_scale`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .deepseek_config import MLAConfig, yarn_mscale
from .rope import apply_rotary


def yarn_frequencies(dim: int, theta: float, p: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [dim // 2], attention_factor) of YaRN."""
    factor = float(p["factor"])
    original = float(p["original_max_position_embeddings"])
    attention = p.get("attention_factor")
    if attention is None:
        mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
                     if mscale and all_dim else yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention)


class LatentRotary(torch.nn.Module):
    """cos/sin [max_pos, rope_dim // 2] (times YaRN's attention factor) and the rotation
    of the decoupled RoPE parts of q and k."""

    def __init__(self, mla: MLAConfig, theta: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        d = mla.qk_rope_head_dim
        if mla.yarn:
            inv_freq, attention = yarn_frequencies(d, theta, mla.yarn)
        else:
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64)
                                        .to(torch.float32) / d))
            attention = 1.0
        self.interleave = mla.rope_interleave
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", (freqs.cos() * attention).to(dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention).to(dtype=dtype, device=device),
                             persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rope_dim // 2] for the tokens' positions (once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, rope_dim] rotated. Interleaved pairs come out de-interleaved (first
        elements, then second ones): q and k alike, so every q.k is unchanged."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)
