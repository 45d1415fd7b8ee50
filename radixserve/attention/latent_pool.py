"""LatentKVPool: the pages of a multi-head latent attention (MLA) model.

Per layer and token it holds what DeepSeek-V2/V3 cache and nothing else: the compressed
latent (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the decoupled RoPE key
(``qk_rope_head_dim`` values, rotated), as two tensors per layer shaped
``[num_pages, page_size, width]``: flashinfer's MLA ``ckv_cache`` / ``kpe_cache`` layout.

It keeps the page ids, page size and byte arithmetic of ``KVPool``, so the radix tree,
copy-on-write, pins, the host/disk tiers and persistence (``page_bytes.pool_tensors``
reads ``page_tensors()``) work on latent pages unchanged. Bytes per token equal what
``radixserve plan`` prints for the config: layers x (kv_lora_rank + qk_rope_head_dim) x
element bytes, plus a 4-byte scale per token and layer when 8-bit (``element`` int8 or
fp8: the latent and RoPE key of a token share one float32 scale, ``kv_quant``'s codec;
pages decode to the compute dtype when read, so a token reads the same values in the step
that writes it as later: cache on equals cache off).
"""

from __future__ import annotations

import torch

from radixserve.attention.pool_storage import as_dtype, check_positive, zeros
from radixserve.attention.kv_quant import SCALE_DTYPE, KVCodec
from radixserve.attention.page_copy import copy_page_prefix
from radixserve.kv_sizing import KVFormat


class LatentKVPool:
    """Latent + RoPE-key storage for every layer, addressed by slot = page * page_size +
    offset (the same slots ``build_metadata`` writes)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype | str, device: torch.device | str,
                 element: str | None = None) -> None:
        """``dtype``: what attention reads; ``element``: how values are stored (default:
        ``dtype``; int8 / fp8_e4m3 / fp8_e5m2 with a scale per token and layer)."""
        check_positive(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                        kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        element = element or str(self.dtype).removeprefix("torch.")
        self.kv_format = KVFormat(element, element)      # what describe/stats lines print
        self.codec = KVCodec.of(element)
        self.ckv = [zeros((num_pages, page_size, kv_lora_rank), self.codec.storage,
                           self.device) for _ in range(num_layers)]
        self.kpe = [zeros((num_pages, page_size, rope_dim), self.codec.storage, self.device)
                    for _ in range(num_layers)]
        self.scale = ([zeros((num_pages, page_size), SCALE_DTYPE, self.device)
                       for _ in range(num_layers)] if self.codec.quantized else [])
        self.ckv_flat = [t.view(-1, kv_lora_rank) for t in self.ckv]
        self.kpe_flat = [t.view(-1, rope_dim) for t in self.kpe]
        self.scale_flat = [t.view(-1) for t in self.scale]

    @property
    def quantized(self) -> bool:
        return self.codec.quantized

    @staticmethod
    def token_bytes(num_layers: int, kv_lora_rank: int, rope_dim: int,
                    element: torch.dtype | str) -> int:
        """Bytes one token takes across all layers (the planner's MLA formula)."""
        codec = KVCodec.of(str(element).removeprefix("torch."))
        itemsize = torch.empty((), dtype=codec.storage).element_size()
        scale = SCALE_DTYPE.itemsize if codec.quantized else 0
        return num_layers * ((kv_lora_rank + rope_dim) * itemsize + scale)

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes(self.num_layers, self.kv_lora_rank, self.rope_dim,
                                self.kv_format.k)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor a page lives in (first dim = page): the tiers' and disk's layout."""
        return self.ckv + self.kpe + self.scale

    def write(self, layer: int, slots: torch.Tensor, ckv: torch.Tensor,
              kpe: torch.Tensor) -> None:
        """Store new tokens' latents [T, kv_lora_rank] and RoPE keys [T, rope_dim]."""
        if ckv.shape != (slots.shape[0], self.kv_lora_rank) or \
                kpe.shape != (slots.shape[0], self.rope_dim):
            raise ValueError(f"LatentKVPool.write: ckv {tuple(ckv.shape)}, kpe "
                             f"{tuple(kpe.shape)} and slots {tuple(slots.shape)} do not match "
                             f"[T, {self.kv_lora_rank}] / [T, {self.rope_dim}]")
        if not self.quantized:
            self.ckv_flat[layer].index_copy_(0, slots, ckv.to(self.dtype))
            self.kpe_flat[layer].index_copy_(0, slots, kpe.to(self.dtype))
            return
        codes, scale = self.codec.encode(torch.cat([ckv, kpe], dim=-1))
        codes = codes.view(torch.uint8)        # index_copy_ has no fp8 kernel everywhere
        self.ckv_flat[layer].view(torch.uint8).index_copy_(0, slots,
                                                           codes[:, :self.kv_lora_rank])
        self.kpe_flat[layer].view(torch.uint8).index_copy_(0, slots,
                                                           codes[:, self.kv_lora_rank:])
        self.scale_flat[layer].index_copy_(0, slots, scale)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents [N, kv_lora_rank], RoPE keys [N, rope_dim]) at ``slots``, in the
        compute dtype (8-bit pages decoded)."""
        ckv = self.ckv_flat[layer].index_select(0, slots)
        kpe = self.kpe_flat[layer].index_select(0, slots)
        if not self.quantized:
            return ckv, kpe
        scale = self.scale_flat[layer].index_select(0, slots)
        values = self.codec.decode(torch.cat([ckv, kpe], dim=-1), scale, self.dtype)
        return values[:, :self.kv_lora_rank], values[:, self.kv_lora_rank:]

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy-on-write of a partly shared page: its first ``num_tokens`` tokens, every
        layer."""
        copy_page_prefix(self.page_tensors(), self.num_pages, self.page_size, src_page,
                         dst_page, num_tokens)

    def __repr__(self) -> str:
        return (f"LatentKVPool(layers={self.num_layers}, pages={self.num_pages}, "
                f"page_size={self.page_size}, latent={self.kv_lora_rank}+{self.rope_dim}, "
                f"dtype={self.dtype}, kv={self.kv_format.k}, device={self.device}, "
                f"{self.total_bytes / 2**20:.1f} MiB)")
