"""The interface of latent-attention (MLA) backends, and the factory that picks one.

An MLA layer hands its backend the query split in two (the part compared with the
decompressed keys, and the RoPE part), the new tokens' latents and RoPE keys, and its
``LatentProjections``; the backend writes the latents into the ``LatentKVPool`` and
returns per-head outputs [T, H, v_head_dim]. How decode attends (absorbed into latent
space, or decompressed for reference) is the backend's business.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from radixserve.attention.backend import AttentionBackend, BackendUnavailable, PlanT
from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.mla_weights import LatentProjections


class MLABackend(AttentionBackend[PlanT]):
    """A backend over latent pages. ``forward`` (per-head K/V in) does not apply."""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> PlanT:
        """Once per step: everything that does not depend on the layer."""

    @abstractmethod
    def forward_latent(self, plan: PlanT, layer: int, q_nope: torch.Tensor,
                       q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       proj: LatentProjections, pool: LatentKVPool) -> torch.Tensor:
        """q_nope [T, H, qk_nope], q_pe [T, H, rope] (rotated), ckv [T, r], kpe [T, rope]
        (rotated): write ckv/kpe at meta.write_slots, attend -> [T, H, v_head_dim]."""

    def forward(self, plan, layer, q, k, v, kv_pool):
        raise TypeError(f"{type(self).__name__} serves latent attention: call "
                        f"forward_latent (ForwardContext.latent_attention)")


def create_mla_backend(name: str, *, num_heads: int, deterministic: bool = False) -> MLABackend:
    """"torch" or "auto" -> the torch MLA backend on CPU; "flashinfer" is refused with the
    reason until the MLA kernel path has run on a GPU (mla_flashinfer.py)."""
    from radixserve.attention.mla_torch import MLATorchBackend
    if deterministic:
        raise ValueError("--deterministic does not support latent-attention (MLA) models "
                         "yet")
    if name == "flashinfer":
        raise BackendUnavailable("--attention-backend flashinfer does not serve latent "
                                 "attention (MLA) models yet; use torch or auto")
    if name not in ("auto", "torch"):
        raise ValueError(f"unknown attention backend {name!r}")
    return MLATorchBackend(num_heads=num_heads)
