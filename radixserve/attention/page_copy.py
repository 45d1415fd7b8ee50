"""Copy-on-write of a partly shared page, for any pool layout: the first tokens of one page
copied into another in every tensor the page lives in (first dim = page, second = token)."""

from __future__ import annotations

from typing import Sequence

import torch


def copy_page_prefix(tensors: Sequence[torch.Tensor], num_pages: int, page_size: int,
                     src_page: int, dst_page: int, num_tokens: int) -> None:
    """Copy the first ``num_tokens`` tokens of ``src_page`` into ``dst_page`` (a prefix
    match that ends inside a shared tree page); ValueError on ids out of range."""
    for name, page in (("src_page", src_page), ("dst_page", dst_page)):
        if not 0 <= page < num_pages:
            raise ValueError(f"{name}={page} out of range [0, {num_pages})")
    if not 0 <= num_tokens <= page_size:
        raise ValueError(f"num_tokens={num_tokens} out of range [0, {page_size}]")
    if src_page == dst_page:
        raise ValueError(f"copy_prefix: src_page and dst_page are both {src_page}")
    for t in tensors if num_tokens else ():
        t[dst_page, :num_tokens].copy_(t[src_page, :num_tokens])
