"""One MLA layer's up-projection from the cached latent, and the three ways to use it.

DeepSeek's ``kv_b_proj`` maps a latent c [kv_lora_rank] to every head's key part without
RoPE (W_UK: [H, qk_nope, r]) and value (W_UV: [H, v, r]). Attention can either
- **decompress** cached latents to per-head K/V (prefill: one GEMM per chunk), or
- run **absorbed** (decode): q_nope.k_nope = (W_UK^T q_nope).c, so the query moves into
  latent space once per token and attends to the latents themselves, and the output
  sum_j p_j v_j = W_UV (sum_j p_j c_j) comes back through W_UV once per token: nothing
  per head is ever built for the cached tokens.

It is a plain Parameter holder, not an ``nn.Linear``: weight quantization (int8/int4) must
not replace it, since absorption reads its exact rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LatentProjections(nn.Module):
    """``kv_b_proj.weight`` [H * (qk_nope + v), kv_lora_rank] (the HF name and layout) and
    the softmax scale of the layer's attention."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, sm_scale: float) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v_dim = num_heads, qk_nope_head_dim, v_head_dim
        self.kv_lora_rank, self.sm_scale = kv_lora_rank, sm_scale
        self.weight = nn.Parameter(torch.empty(num_heads * (qk_nope_head_dim + v_head_dim),
                                               kv_lora_rank), requires_grad=False)

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope, r] (a view)."""
        return self.weight.view(self.num_heads, self.nope + self.v_dim, -1)[:, :self.nope]

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, v, r] (a view)."""
        return self.weight.view(self.num_heads, self.nope + self.v_dim, -1)[:, self.nope:]

    def decompress(self, ckv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [N, r] -> per-head (k_nope [N, H, qk_nope], v [N, H, v]): the only
        place per-head K/V is built (prefill; the decompressed reference decode)."""
        kv = F.linear(ckv, self.weight).view(ckv.shape[0], self.num_heads, -1)
        return kv[..., :self.nope], kv[..., self.nope:]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, qk_nope] -> its latent-space form [T, H, r] (q . W_UK per head)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [T, H, r] -> per-head values [T, H, v]."""
        return torch.bmm(o_latent.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)
