"""Latent attention (MLA) in plain torch: the CPU path and the reference for flashinfer's.

Per step, ``prepare`` turns the page table into pool slots once: each prefill span's whole
context, and the decodes' contexts padded to the longest one. Per layer,
``forward_latent`` writes the new tokens' latents and RoPE keys into the pool, then
- attends each prefill span by **decompressing** its context's latents to per-head K/V
  (one GEMM through ``kv_b_proj``), bottom-right causal, softmax in fp32, and
- attends all decodes together **absorbed** (the default): each query moves into latent
  space through W_UK, scores are q_latent . c + q_pe . k_pe against the gathered latent
  rows themselves, the probabilities weight the latents, and W_UV maps the result back.
  Per-head K/V is never built for cached tokens. ``absorbed=False`` decompresses instead:
  the reference the absorbed path is tested against, and the bench's baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.mla_backend import MLABackend
from radixserve.attention.mla_weights import LatentProjections
from radixserve.attention.torch_plans import StepTables


@dataclass(frozen=True, slots=True)
class LatentSpan:
    """One prefill span: its new tokens' rows, its context's slots, its cached length."""
    rows: slice
    slots: torch.Tensor           # int64 [kv_len]
    cached: int


@dataclass(slots=True)
class MLAPlan:
    meta: AttentionMetadata
    prefills: list[LatentSpan] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None     # int64 [B]: the decodes' token rows
    decode_slots: torch.Tensor | None = None    # int64 [B, L]: contexts, padded with slot 0
    decode_mask: torch.Tensor | None = None     # float32 [B, 1, L]: 0 or -inf (padding)


def plan_latent_step(meta: AttentionMetadata) -> MLAPlan:
    """The step's slots: per prefill span, and padded for all decodes."""
    t = StepTables.of(meta)
    plan = MLAPlan(meta)
    for b in range(meta.num_prefills):
        kv_len = int(t.kv_lens[b])
        plan.prefills.append(LatentSpan(
            slice(int(t.qo_indptr[b]), int(t.qo_indptr[b + 1])),
            t.tensor(t.slots(b, np.arange(kv_len, dtype=np.int64))),
            kv_len - int(t.new_lens[b])))
    if meta.num_decodes:
        seqs = np.arange(meta.num_prefills, meta.batch_size)
        lens = t.kv_lens[seqs]
        pos = np.arange(int(lens.max()), dtype=np.int64)
        valid = pos[None, :] < lens[:, None]
        slots = t.slots(seqs[:, None], np.where(valid, pos[None, :], 0))
        mask = np.where(valid, 0.0, -np.inf).astype(np.float32)[:, None, :]
        plan.decode_rows = t.tensor(t.qo_indptr[seqs])
        plan.decode_slots, plan.decode_mask = t.tensor(slots), t.tensor(mask)
    return plan


def _softmax_weighted(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores) in fp32 (as transformers), rounded to the values' dtype, @ values."""
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype), values)


class MLATorchBackend(MLABackend[MLAPlan]):
    name = "torch"

    def __init__(self, *, num_heads: int, absorbed: bool = True) -> None:
        self.num_heads = num_heads
        self.absorbed = absorbed

    def prepare(self, meta: AttentionMetadata) -> MLAPlan:
        return plan_latent_step(meta)

    def forward_latent(self, plan: MLAPlan, layer: int, q_nope: torch.Tensor,
                       q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       proj: LatentProjections, pool: LatentKVPool) -> torch.Tensor:
        pool.write(layer, plan.meta.write_slots, ckv, kpe)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, proj.v_dim)
        for span in plan.prefills:
            out[span.rows] = self._prefill(span, layer, q_nope[span.rows], q_pe[span.rows],
                                           proj, pool)
        if plan.decode_rows is not None:
            decode = self._decode_absorbed if self.absorbed else self._decode_decompressed
            out[plan.decode_rows] = decode(plan, layer, q_nope[plan.decode_rows],
                                           q_pe[plan.decode_rows], proj, pool)
        return out

    @staticmethod
    def _prefill(span: LatentSpan, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                 proj: LatentProjections, pool: LatentKVPool) -> torch.Tensor:
        """One span's new tokens against its whole context, decompressed: [n, H, v]."""
        ckv, kpe = pool.read(layer, span.slots)
        ckv, kpe = ckv.to(q_nope.dtype), kpe.to(q_nope.dtype)
        k_nope, v = proj.decompress(ckv)                          # [L, H, nope], [L, H, v]
        scores = (torch.matmul(q_nope.transpose(0, 1), k_nope.permute(1, 2, 0))
                  + torch.matmul(q_pe.transpose(0, 1), kpe.t()))   # [H, n, L]
        scores = scores * proj.sm_scale
        n, kv_len = q_nope.shape[0], span.slots.shape[0]
        causal = (torch.arange(kv_len, device=scores.device)[None, :]
                  > span.cached + torch.arange(n, device=scores.device)[:, None])
        scores.masked_fill_(causal, float("-inf"))
        return _softmax_weighted(scores, v.transpose(0, 1)).transpose(0, 1)

    @staticmethod
    def _gather(plan: MLAPlan, layer: int, pool: LatentKVPool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' contexts: latents [B, L, r] and RoPE keys [B, L, rope]."""
        b, length = plan.decode_slots.shape
        ckv, kpe = pool.read(layer, plan.decode_slots.reshape(-1))
        return ckv.view(b, length, -1).to(dtype), kpe.view(b, length, -1).to(dtype)

    def _decode_absorbed(self, plan: MLAPlan, layer: int, q_nope: torch.Tensor,
                         q_pe: torch.Tensor, proj: LatentProjections,
                         pool: LatentKVPool) -> torch.Tensor:
        """Decodes in latent space: q through W_UK, latents attended, out through W_UV."""
        ckv, kpe = self._gather(plan, layer, pool, q_nope.dtype)  # [B, L, r], [B, L, rope]
        q_latent = proj.absorb_query(q_nope)                       # [B, H, r]
        scores = torch.baddbmm(torch.bmm(q_pe, kpe.transpose(1, 2)), q_latent,
                               ckv.transpose(1, 2))                # [B, H, L]
        scores = scores * proj.sm_scale + plan.decode_mask
        return proj.expand_output(_softmax_weighted(scores, ckv))  # [B, H, v]

    def _decode_decompressed(self, plan: MLAPlan, layer: int, q_nope: torch.Tensor,
                             q_pe: torch.Tensor, proj: LatentProjections,
                             pool: LatentKVPool) -> torch.Tensor:
        """The reference: every cached token's K/V rebuilt per head, then attended."""
        ckv, kpe = self._gather(plan, layer, pool, q_nope.dtype)
        b, length, _ = ckv.shape
        k_nope, v = proj.decompress(ckv.reshape(b * length, -1))
        k_nope = k_nope.view(b, length, self.num_heads, -1).permute(0, 2, 3, 1)  # [B,H,n,L]
        v = v.view(b, length, self.num_heads, -1).transpose(1, 2)               # [B,H,L,v]
        scores = (torch.matmul(q_nope.unsqueeze(2), k_nope).squeeze(2)
                  + torch.bmm(q_pe, kpe.transpose(1, 2)))                       # [B, H, L]
        scores = scores * proj.sm_scale + plan.decode_mask
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(v.dtype)
                            .unsqueeze(2), v).squeeze(2)
