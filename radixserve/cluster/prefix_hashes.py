"""Routing-block hashes: how replicas publish their caches and how the router names a
prompt.

A block's routing hash is the first 8 bytes of its path hash (cache/path_hash.py: chained
over the namespace and every token up to the block's end), as an int. Equal hashes
therefore mean equal namespaced prefixes, a prefix match is a walk over the hashes, and two
namespaces never share a hash, so no tenant can even be routed by another's cache. Only
whole blocks are hashed: a replica that holds a partial block is credited with the whole
blocks before it (page-aligned, never over).
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.path_hash import block_int, prompt_path_hashes
from radixserve.cache.token_keys import TokenIds

DEFAULT_BLOCK_TOKENS = 16


def routing_block_tokens(page_size: int) -> int:
    """Tokens per routing block: the engine's page when pages are large, else 16 tokens
    (page_size 1 would publish one hash per cached token)."""
    return page_size if page_size >= DEFAULT_BLOCK_TOKENS else DEFAULT_BLOCK_TOKENS


def to_int(digest: bytes) -> int:
    """A path hash as a routing hash (its first 8 bytes)."""
    return block_int(digest)


def prompt_hashes(tokens: TokenIds, block_tokens: int, namespace: str | None) -> list[int]:
    """The routing hash of each whole block of `tokens`, in order."""
    return [to_int(h) for h in prompt_path_hashes(tokens, block_tokens, namespace)]


def matched_blocks(hashes: Sequence[int], held: set[int] | frozenset[int]) -> int:
    """How many leading blocks of a prompt `held` contains."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
