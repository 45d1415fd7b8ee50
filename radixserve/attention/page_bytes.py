"""A KV pool page as bytes and back: what the disk tier keeps of it.

One page's payload is, in order, the page's slice of every K layer, every V layer, then
(8-bit formats only) every K scale layer and every V scale layer, each as its raw stored
bytes (codes stay codes: a restored page decodes exactly as the original). Its length is
`page_payload_bytes(pool)`, the pool's own arithmetic (kv_sizing) for `page_size` tokens.
The one definition of that layout: the tier mover (L3 writes and loads) and the cache
saver both use it. Runs on the compute thread, batched: one gather per tensor, not one
per page.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .kv_pool import KVPool

__all__ = ["bytes_to_pages", "page_payload_bytes", "pages_to_bytes", "pool_tensors",
           "rows_to_bytes"]


def pool_tensors(pool: KVPool) -> list[torch.Tensor]:
    """Every tensor a page lives in, first dim = page (each pool names its own: K and V
    per layer then scales, or latents then RoPE keys)."""
    return pool.page_tensors()


def page_payload_bytes(pool: KVPool) -> int:
    """Bytes of one page in host memory or on disk (== page_size * bytes_per_token)."""
    return pool.bytes_per_token * pool.page_size


def pages_to_bytes(pool: KVPool, pages: Sequence[int]) -> list[bytes]:
    """The payload of each page in `pages` (pool page ids)."""
    return rows_to_bytes(pool_tensors(pool), pages)


def rows_to_bytes(tensors: Sequence[torch.Tensor], ids: Sequence[int]) -> list[bytes]:
    """Page payloads from tensors laid out as the pool's (first dim = page; the host tier's
    slots are), rows `ids`."""
    if not len(ids):
        return []
    if not len(tensors):        # a pool of no layers (every layer of the model windowed)
        return [b""] * len(ids)
    parts = []                                   # per tensor: uint8 [n, bytes of one page]
    for t in tensors:
        index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=t.device)
        rows = t.index_select(0, index).view(torch.uint8).reshape(len(ids), -1)
        parts.append(rows.cpu().numpy())
    joined = np.concatenate(parts, axis=1)       # [n, payload bytes]
    return [joined[i].tobytes() for i in range(len(ids))]


def bytes_to_pages(pool: KVPool, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write each payload into its pool page (the inverse of pages_to_bytes). A payload of
    another length was written by another KV layout: ValueError, nothing written."""
    if not len(pages):
        return
    size = page_payload_bytes(pool)
    bad = [len(p) for p in payloads if len(p) != size]
    if bad or len(payloads) != len(pages):
        raise ValueError(f"page payloads of {bad[:1] or len(payloads)} bytes; {size} bytes "
                         f"for each of {len(pages)} pages expected (another KV layout?)")
    joined = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(pages), size)
    index = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=pool.device)
    offset = 0
    for t in pool_tensors(pool):
        dst = t.view(torch.uint8).view(t.shape[0], -1)      # [num_pages, bytes of one page]
        width = dst.shape[1]
        src = torch.from_numpy(joined[:, offset:offset + width].copy()).to(pool.device)
        dst.index_copy_(0, index, src)
        offset += width
