"""ForwardContext: what one step's forward pass needs besides its tokens.

Built once per step (`ForwardContext.prepare`), handed to the model, and read by every
layer: the step's page table, the backend with the plan it made for that table, and the
KV pool the layers write into and attend over. The plan's type follows the backend's
(`TorchPlan` for the torch backend, `FlashInferPlan` for flashinfer), so a plan can only
be given to the backend that made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

import torch

from radixserve.attention.backend import AttentionBackend, PlanT
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.kv_pool import KVPool


@dataclass(frozen=True, slots=True)
class GroupStep:
    """One layer group's part of a step when groups have their own pools (hybrid models):
    its layers, backend, plan over its own page table, and pool."""
    layers: frozenset[int]
    backend: AttentionBackend
    plan: object
    kv_pool: KVPool


@dataclass(frozen=True, slots=True)
class ForwardContext(Generic[PlanT]):
    meta: AttentionMetadata
    backend: AttentionBackend[PlanT]
    plan: PlanT
    kv_pool: KVPool
    windowed: GroupStep | None = None   # sliding-window layers' own pool, if they have one

    @classmethod
    def prepare(cls, backend: AttentionBackend[PlanT], meta: AttentionMetadata,
                kv_pool: KVPool, windowed: GroupStep | None = None) -> ForwardContext[PlanT]:
        """Plan the step (flashinfer: plan its kernels; torch: build gather indices)."""
        return cls(meta, backend, backend.prepare(meta), kv_pool, windowed)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        """Write this layer's new k/v into the pool and attend: [T, Hq, D] -> [T, Hq, D]."""
        w = self.windowed
        if w is not None and layer in w.layers:
            return w.backend.forward(w.plan, layer, q, k, v, w.kv_pool)
        return self.backend.forward(self.plan, layer, q, k, v, self.kv_pool)

    def latent_attention(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         ckv: torch.Tensor, kpe: torch.Tensor, proj) -> torch.Tensor:
        """MLA (the backend is an ``MLABackend``, the pool a ``LatentKVPool``): write the
        new latents and RoPE keys, attend -> [T, H, v_head_dim]."""
        return self.backend.forward_latent(self.plan, layer, q_nope, q_pe, ckv, kpe, proj,
                                           self.kv_pool)
