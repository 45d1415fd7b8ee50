"""Shared by the disk store tests and their crash writer: a fingerprint, page contents
that name their key, and edges whose tokens name their pages (so a restored node whose
pages hold other content is caught)."""

from __future__ import annotations

import hashlib

from radixserve.storage import ModelFingerprint
from radixserve.storage.store_index import IndexNode

PAGE_SIZE = 4


def fingerprint(**changes) -> ModelFingerprint:
    fields = dict(weights_sha256="ab" * 32, dtype="float32", page_size=PAGE_SIZE,
                  kv_layout="NHD k=float32 v=float32", num_layers=2, num_kv_heads=1,
                  head_dim=8, code="c0de")
    fields.update(changes)
    return ModelFingerprint(**fields)


def payload_for(key: int, size: int = 4096) -> bytes:
    block = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def tokens_for(contents: list[int]) -> list[int]:
    """An edge's tokens naming the content of each of its pages (`payload_for(c)`)."""
    return [c * 100 + j for c in contents for j in range(PAGE_SIZE)]


def contents_of(token_ids: list[int]) -> list[int]:
    return [t // 100 for t in token_ids[::PAGE_SIZE]]


def node(node_id: int, parent_id: int | None, page_keys: list[int],
         namespace: str | None = None, contents: list[int] | None = None) -> IndexNode:
    """A node whose page i holds `payload_for(contents[i])` (default: its key)."""
    return IndexNode(node_id, parent_id, namespace, tokens_for(contents or page_keys),
                     list(page_keys))
