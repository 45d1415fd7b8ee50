"""DeepSeek's feed-forward blocks: the dense gated MLP and the MoE (router, routed experts,
shared experts).

On CPU the routed experts run as a loop over the experts some token was routed to, each on
its tokens only: correct and simple, not fast (a grouped GEMM is the GPU's business).
The router computes in float32 whatever the working dtype (transformers keeps the gate's
weight and score bias in float32 too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .deepseek_config import MoEConfig
from .packed_linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Tokens -> (expert ids [T, k], weights [T, k] float32).

    V2 ("softmax"): softmax scores, top-k over all experts ("greedy") or within the
    `topk_groups` groups holding the best single expert ("group_limited_greedy").
    V3 ("sigmoid", "noaux_tc"): sigmoid scores; the groups and the experts are chosen on
    scores + `e_score_correction_bias` (groups by their two best), the weights are the
    plain scores, normalised when `norm_topk_prob`. Both scaled by routed_scaling_factor.
    """

    def __init__(self, cfg: MoEConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
            if cfg.scoring == "sigmoid" else None)

    def _group_mask(self, choice: torch.Tensor, group_score: torch.Tensor) -> torch.Tensor:
        """bool [T, E]: the experts inside each token's best `topk_groups` groups."""
        c = self.cfg
        groups = torch.topk(group_score, k=c.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        return keep.repeat_interleave(c.num_experts // c.num_groups, dim=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        grouped = (-1, c.num_groups, c.num_experts // c.num_groups)
        if c.scoring == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if c.topk_method == "group_limited_greedy":
                keep = self._group_mask(scores, scores.view(grouped).max(dim=-1).values)
                scores = scores.masked_fill(~keep, 0.0)
            weights, ids = torch.topk(scores, k=c.top_k, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            keep = self._group_mask(choice, choice.view(grouped).topk(2, dim=-1)[0].sum(-1))
            ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=c.top_k, dim=-1,
                             sorted=False)[1]
            weights = scores.gather(1, ids)
            if c.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts (each a GatedMLP of moe_intermediate_size) plus shared experts (one
    GatedMLP of moe_intermediate_size * n_shared_experts) that every token goes through."""

    def __init__(self, cfg: MoEConfig, hidden: int):
        super().__init__()
        self.gate = Router(cfg, hidden)
        self.experts = nn.ModuleList(GatedMLP(hidden, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.shared_experts = (GatedMLP(hidden, cfg.moe_intermediate_size
                                        * cfg.num_shared_experts)
                               if cfg.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():          # the experts some token chose
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            # index_put_ accumulates like index_add_ (each token once per expert), but
            # index_add_ took ~8.5 ms per call on a [1, 64] row here (torch 2.13 CPU)
            out.index_put_((token,), y.to(out.dtype), accumulate=True)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
