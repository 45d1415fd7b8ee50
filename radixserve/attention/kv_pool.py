"""KVPool: the per-layer K/V tensors that pages index into.

Layout per layer is ``[num_pages, page_size, num_kv_heads, head_dim]`` (flashinfer "NHD"),
so the same tensors feed the torch backend and flashinfer's paged kernels unchanged. The
pool only stores data; which page belongs to whom is the allocator's and the tree's job.

K and V may each be stored in 8 bits (``kv_format``; see ``kv_quant``): codes in those
tensors and one float32 scale per token and KV head beside them (``k_scale`` / ``v_scale``,
``[num_pages, page_size, num_kv_heads]``), written together and copied together.

This module imports torch; ``radixserve.cache`` never imports it (the cache package must
load without torch).
"""

from __future__ import annotations

from typing import Sequence

import torch

from radixserve.attention.kv_quant import SCALE_DTYPE, KVCodec
from radixserve.attention.page_copy import copy_page_prefix
from radixserve.attention.pool_storage import as_dtype, check_positive, zeros
from radixserve.kv_sizing import KVFormat, pool_pages



class KVPool:
    """K and V storage for every layer, addressed by slot = page * page_size + offset."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype | str, device: torch.device | str,
                 kv_format: KVFormat | None = None, fixed_scale: float | None = None,
                 layers: Sequence[int] | None = None) -> None:
        """``dtype``: the compute dtype (what attention reads); ``kv_format``: how K and V
        are stored (default: both in ``dtype``); ``fixed_scale``: one scale for every
        quantized token (flashinfer's per-tensor scales) instead of per token and head;
        ``layers``: the model layers this pool stores (one layer group of a hybrid model;
        the others' entries are None), default all."""
        check_positive(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                        num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.num_layers = num_layers
        self.layers = tuple(range(num_layers)) if layers is None else tuple(layers)
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        name = str(self.dtype).removeprefix("torch.")
        self.kv_format = kv_format or KVFormat(name, name)
        self.k_codec = KVCodec.of(self.kv_format.k, fixed_scale)
        self.v_codec = KVCodec.of(self.kv_format.v, fixed_scale)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k, self.k_flat, self.k_scale, self.k_scale_flat = self._side(self.k_codec, shape)
        self.v, self.v_flat, self.v_scale, self.v_scale_flat = self._side(self.v_codec, shape)

    def _side(self, codec: KVCodec, shape: tuple[int, ...]):
        """Per-layer storage of one side, its token-granular views (what write() and the
        torch backend index), and the scales with theirs (None when not quantized)."""
        stored = set(self.layers)
        data = [zeros(shape, codec.storage, self.device) if i in stored else None
                for i in range(self.num_layers)]
        flat = [None if t is None else t.view(-1, *shape[2:]) for t in data]
        if not codec.quantized:
            return data, flat, None, None
        scales = [zeros(shape[:3], SCALE_DTYPE, self.device) if i in stored else None
                  for i in range(self.num_layers)]
        return data, flat, scales, [None if t is None else t.view(-1, shape[2])
                                    for t in scales]

    def side(self, name: str, layer: int):
        """(codec, token-granular data, token-granular scales or None) of "k" or "v"."""
        scales = getattr(self, f"{name}_scale_flat")
        return (getattr(self, f"{name}_codec"), getattr(self, f"{name}_flat")[layer],
                None if scales is None else scales[layer])

    @property
    def quantized(self) -> bool:
        return self.k_codec.quantized or self.v_codec.quantized

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.kv_format.token_bytes(len(self.layers), self.num_kv_heads, self.head_dim)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype | str) -> int:
        """Bytes one token's K and V take across all layers (kv_sizing's arithmetic)."""
        name = str(as_dtype(dtype)).removeprefix("torch.")
        return KVFormat(name, name).token_bytes(num_layers, num_kv_heads, head_dim)

    @staticmethod
    def pages_for_budget(budget_bytes: int | float, num_layers: int, page_size: int,
                         num_kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> int:
        """How many whole pages fit in ``budget_bytes``; ValueError if not even one."""
        check_positive(num_layers=num_layers, page_size=page_size,
                        num_kv_heads=num_kv_heads, head_dim=head_dim)
        return pool_pages(token_bytes=KVPool.token_bytes(num_layers, num_kv_heads, head_dim,
                                                         dtype),
                          page_size=page_size, kv_cache_tokens=None, budget=budget_bytes)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              decoded: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Store new tokens' K/V: slots int64 [T], k/v [T, Hkv, D].

        Returns the K/V attention must use for these tokens: k/v themselves, or for an
        8-bit side what the stored codes decode to, so a token reads the same values in
        the step that computes it as in every later step (cache on equals cache off).
        ``decoded=False``: returns None, for callers that read the new tokens back from
        the pool (decoding an 8-bit side costs ~25 us per layer and side on CPU)."""
        k_dst, v_dst = self.k_flat[layer], self.v_flat[layer]
        if k.shape != v.shape or k.shape[1:] != k_dst.shape[1:] or k.shape[0] != slots.shape[0]:
            raise ValueError(f"KVPool.write: k {tuple(k.shape)}, v {tuple(v.shape)} and slots "
                             f"{tuple(slots.shape)} do not match [T, {self.num_kv_heads}, "
                             f"{self.head_dim}]")
        used = (self._write_side(self.k_codec, k_dst, self.k_scale_flat, layer, slots, k,
                                 decoded),
                self._write_side(self.v_codec, v_dst, self.v_scale_flat, layer, slots, v,
                                 decoded))
        return used if decoded else None

    def _write_side(self, codec: KVCodec, dst: torch.Tensor,
                    scales: list[torch.Tensor] | None, layer: int, slots: torch.Tensor,
                    x: torch.Tensor, decoded: bool) -> torch.Tensor | None:
        if not codec.quantized:
            stored = x.to(dst.dtype)
            dst.index_copy_(0, slots, stored)
            return x if stored is x else stored.to(x.dtype)
        codes, scale = codec.encode(x)
        # index_copy_ has no fp8 kernel on every device: move the same bytes as uint8.
        dst.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
        scales[layer].index_copy_(0, slots, scale)
        return codec.decode(codes, scale, x.dtype) if decoded else None

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens of a page into another, in every layer.

        Copy-on-write for a prefix match that ends inside a shared tree page.
        """
        # Scales travel with their codes: a copied token decodes to the same values.
        copy_page_prefix(self.page_tensors(), self.num_pages, self.page_size, src_page,
                         dst_page, num_tokens)

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor a page lives in (first dim = page): K and V per layer, then scales;
        layers of another group (`layers=`) hold None and are left out."""
        tensors = self.k + self.v + (self.k_scale or []) + (self.v_scale or [])
        return [t for t in tensors if t is not None]

    def __repr__(self) -> str:
        return (f"KVPool(layers={len(self.layers)}, pages={self.num_pages}, "
                f"page_size={self.page_size}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, "
                f"kv={self.kv_format.describe()}, device={self.device}, "
                f"{self.total_bytes / 2**20:.1f} MiB)")
