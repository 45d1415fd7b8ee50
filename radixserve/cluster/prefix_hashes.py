"""Chained prefix hashes of routing blocks: how replicas publish their caches and how the
router names a prompt.

A prompt of tokens t is cut into blocks of `block_tokens`; block i's hash covers the
namespace and every token up to the end of block i (hash_i = H(hash_{i-1}, block_i), with
hash_{-1} = H(namespace)). Equal hashes therefore mean equal namespaced prefixes, a prefix
match is a walk over the hashes, and two namespaces never share a hash, so no tenant can
even be routed by another's cache. Only whole blocks are hashed: a replica that holds a
partial block is credited with the whole blocks before it (page-aligned, never over).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from radixserve.cache.token_keys import ITEM_BYTES, TokenIds, pack

DEFAULT_BLOCK_TOKENS = 16


def routing_block_tokens(page_size: int) -> int:
    """Tokens per routing block: the engine's page when pages are large, else 16 tokens
    (page_size 1 would publish one hash per cached token)."""
    return page_size if page_size >= DEFAULT_BLOCK_TOKENS else DEFAULT_BLOCK_TOKENS


def namespace_seed(namespace: str | None) -> bytes:
    """The chain's start for a namespace (None, the shared namespace, included)."""
    tag = b"\x00" if namespace is None else b"\x01" + namespace.encode()
    return hashlib.blake2b(tag, digest_size=8).digest()


def chain(previous: bytes, block: bytes) -> bytes:
    """The hash of a block given the hash of everything before it."""
    return hashlib.blake2b(block, digest_size=8, key=previous).digest()


def to_int(digest: bytes) -> int:
    return int.from_bytes(digest, "little")


def prompt_hashes(tokens: TokenIds, block_tokens: int, namespace: str | None) -> list[int]:
    """The chained hash of each whole block of `tokens`, in order."""
    key = pack(tokens)
    step = block_tokens * ITEM_BYTES
    h = namespace_seed(namespace)
    out = []
    for start in range(0, len(key) - step + 1, step):
        h = chain(h, key[start:start + step])
        out.append(to_int(h))
    return out


def matched_blocks(hashes: Sequence[int], held: set[int] | frozenset[int]) -> int:
    """How many leading blocks of a prompt `held` contains."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
