"""Latent attention on CUDA through flashinfer's MLA kernel
(``flashinfer.mla.BatchMLAPagedAttentionWrapper``), written against its signature in
flashinfer-python 0.6.18.post1 (``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr,
num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
kv_data_type)``, ``run(q_nope, q_pe, ckv_cache, kpe_cache)``).

The kernel reads ``LatentKVPool``'s per-layer ``ckv`` [pages, page_size, kv_lora_rank]
and ``kpe`` [pages, page_size, rope] as they are. Every token runs absorbed (prefill
chunks too: the kernel's causal mask is bottom-right aligned, so a chunk continuing a
cached prefix needs nothing else): q_nope goes through W_UK first, the kernel returns
latent-space outputs [T, H, kv_lora_rank], W_UV maps them back. One plan per step serves
every layer (DeepSeek's softmax scale is the same in all of them).

Not yet run on a GPU: ``create_mla_backend`` does not pick it; ``scripts/gpu_check_mla.py``
checks it against the torch MLA backend when a GPU is lent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.mla_backend import MLABackend
from radixserve.attention.mla_weights import LatentProjections

WORKSPACE_BYTES = 128 * 2**20          # flashinfer's example size for the float workspace


@dataclass(frozen=True, slots=True)
class FlashInferMLAPlan:
    meta: AttentionMetadata


def mla_plan_args(meta: AttentionMetadata, *, num_heads: int, kv_lora_rank: int,
                  rope_dim: int, sm_scale: float, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """The keyword arguments of ``BatchMLAPagedAttentionWrapper.plan`` for one step:
    indptrs and page ids as int32 on the device, each request's KV length, causal."""
    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.int32, non_blocking=True)
    return dict(qo_indptr=dev(meta.qo_indptr), kv_indptr=dev(meta.kv_indptr),
                kv_indices=dev(meta.kv_indices),
                kv_len_arr=dev(torch.tensor(meta.kv_lens, dtype=torch.int32)),
                num_heads=num_heads, head_dim_ckv=kv_lora_rank, head_dim_kpe=rope_dim,
                page_size=meta.page_size, causal=True, sm_scale=sm_scale,
                q_data_type=dtype, kv_data_type=dtype)


class FlashInferMLABackend(MLABackend[FlashInferMLAPlan]):
    name = "flashinfer"

    def __init__(self, *, num_heads: int, kv_lora_rank: int, rope_dim: int, sm_scale: float,
                 dtype: torch.dtype, device: torch.device | str, wrapper_cls=None) -> None:
        """``wrapper_cls``: the wrapper class (tests pass a fake bound to its signature)."""
        if wrapper_cls is None:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper as wrapper_cls
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.sm_scale, self.dtype = sm_scale, dtype
        self.device = torch.device(device)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = wrapper_cls(workspace, backend="auto")

    def prepare(self, meta: AttentionMetadata) -> FlashInferMLAPlan:
        self.wrapper.plan(**mla_plan_args(
            meta, num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim, sm_scale=self.sm_scale, dtype=self.dtype,
            device=self.device))
        return FlashInferMLAPlan(meta)

    def forward_latent(self, plan: FlashInferMLAPlan, layer: int, q_nope: torch.Tensor,
                       q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       proj: LatentProjections, pool: LatentKVPool) -> torch.Tensor:
        if pool.quantized:
            raise ValueError("the flashinfer MLA path reads 16-bit latents only")
        pool.write(layer, plan.meta.write_slots, ckv, kpe)
        q_latent = proj.absorb_query(q_nope).contiguous()
        o_latent = self.wrapper.run(q_latent, q_pe.contiguous(), pool.ckv[layer],
                                    pool.kpe[layer])
        return proj.expand_output(o_latent)
