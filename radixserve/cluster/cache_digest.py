"""A replica's cache as a set of chained block hashes: a read-only walk of its radix tree.

The walk (cache/path_hash.py: `walk_path_hashes`, the one the disk store's saves use too)
visits each node once, parents before children, so a block that spans several edges
hashes exactly as `prompt_hashes` hashes the same prompt. It
touches no node (no clock, no hit count) and must run on the thread that owns the tree
(the engine's event loop) with no await in between, so the tree cannot change under it.
Cost: one blake2b per cached block (about a microsecond), bounded by `max_blocks`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.cache.path_hash import walk_path_hashes

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache

DEFAULT_MAX_BLOCKS = 1 << 20


@dataclass(frozen=True)
class CacheDigest:
    """What a replica holds, as of `taken_at` (time.time() on the replica)."""

    hashes: frozenset[int]
    block_tokens: int
    taken_at: float
    walk_seconds: float = 0.0
    truncated: bool = False            # more than max_blocks cached: the rest not listed
    version: int = 0                   # counts the replica's digests; equal: same content


@dataclass
class DigestMaker:
    """Makes digests of one cache, re-walking only when the tree may have changed."""

    cache: "RadixCache"
    block_tokens: int
    max_blocks: int = DEFAULT_MAX_BLOCKS
    _last: CacheDigest | None = None
    _last_mark: tuple | None = field(default=None, repr=False)

    def digest(self) -> CacheDigest:
        mark = self._change_mark()
        if self._last is not None and mark == self._last_mark:
            return CacheDigest(self._last.hashes, self.block_tokens, time.time(),
                               self._last.walk_seconds, self._last.truncated,
                               self._last.version)
        start = time.perf_counter()
        hashes, truncated = walk_hashes(self.cache, self.block_tokens, self.max_blocks)
        version = self._last.version + 1 if self._last is not None else 1
        self._last = CacheDigest(hashes, self.block_tokens, time.time(),
                                 time.perf_counter() - start, truncated, version)
        self._last_mark = mark
        return self._last

    def _change_mark(self) -> tuple:
        """Changes whenever the tree's content may have: inserts, splits, evictions, flushes.
        (The logical clock also moves on lookups: a spare walk, never a missed change.)"""
        c = self.cache
        return (c.clock, c.total_tokens, c.num_nodes, c.evicted_tokens)


def walk_hashes(cache: "RadixCache", block_tokens: int,
                max_blocks: int = DEFAULT_MAX_BLOCKS) -> tuple[frozenset[int], bool]:
    """Every whole block's routing hash in `cache`, and whether `max_blocks` cut it short."""
    out: set[int] = set()
    for _, hashes in walk_path_hashes(cache, block_tokens):
        out.update([int.from_bytes(h[:8], "little") for h in hashes])     # to_int's, inline
        if len(out) >= max_blocks:
            return frozenset(out), True
    return frozenset(out), False
