"""TreeNode: one edge of the radix tree and the KV pages that hold its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from .tier_types import Tier
from .token_keys import ITEM_BYTES, pack_range, unpack

__all__ = ["TreeNode"]

_PACK_WHOLE = 8192          # tokens: an edge held as an array/numpy ids packs whole up to this
_PACK_WHOLE_LIST = 1024     #   and as a list (packing a list costs ~10x a memcpy)


@dataclass(slots=True, eq=False)
class TreeNode:
    """An edge: `key` (the token ids after the parent) and `pages` (the ids holding them).

    Namespace roots have an empty key and `depth == 0`; they hold nothing, are never locked
    or evicted and are not counted in `num_nodes`. Identity equality (eq=False): two nodes
    with equal fields are still different places in the tree.

    A new leaf keeps a reference to the caller's ids (a list, `array('q')` or numpy array)
    and their range (`_pending`) and packs them on the first read of `key`: on long prompts
    most leaves are evicted unread, and packing costs a copy (~1 ns per token from an
    array, ~5-15 from a list). So ids given to `RadixCache.insert` must not be changed in
    place afterwards (appending is fine) -- as with SGLang, whose tree keeps the caller's
    token list itself.
    """

    id: int
    _key: bytes | None             # packed token ids (token_keys.py), or None while
                                   #   `_pending` holds them; num_tokens == len(pages) * page_size
    pages: np.ndarray              # int32, read-only (callers get views of it)
    parent: TreeNode | None        # None for namespace roots and for evicted (stale) nodes
    depth: int                     # tokens from the namespace root to the end of this edge
    namespace: str | None
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0              # locks held at this node or below
    last_access: int = 0           # the cache's logical clock at the last match/insert
    hit_count: int = 0             # match_prefix calls that used this node's tokens
    evict_key: Any = None          # its EvictionQueue entry (policy key, id, ...) while
                                   #   it is an evictable leaf, else None
    cow_index: dict[int, list[TreeNode]] | None = None  # page_size > 1: children by 1st token
    _pending: tuple | None = None  # (list, start, stop) of the ids until `key` is read
    filed_as: bytes = b""           # its key in parent.children (its first page, packed)
    # Where `pages` are (tier_types.py): Tier.POOL, the KV pool; HOST or DISK (cache/tiers.py).
    # `pages` are TreeIds in every tier: one id space, pool pages first, then host slots,
    # then disk slots, so ids of different tiers never collide. A node's parent is in its
    # tier or a higher one.
    tier: Tier = Tier.POOL

    @property
    def key(self) -> bytes:
        """The edge's token ids, packed (token_keys.py)."""
        key = self._key
        if key is None:
            key = self._key = pack_range(*self._pending)
            self._pending = None
        return key

    def pack(self) -> None:
        """Pack the edge's ids now (an edge matched whole is likely to be read again)."""
        if self._pending is not None:
            self._key = pack_range(*self._pending)
            self._pending = None

    def key_parts(self) -> tuple[bytes | None, tuple | None]:
        """The key as held now, (packed, None) or (None, pending): a TreeNode built with
        them has the same tokens without packing them here (events/tree_facts.py)."""
        return self._key, self._pending

    @key.setter
    def key(self, value: bytes) -> None:
        self._key = value
        self._pending = None

    def head(self, num_tokens: int) -> bytes:
        """The packed first `num_tokens` token ids (without packing the rest)."""
        if self._key is not None:
            return self._key[:num_tokens * ITEM_BYTES]
        ids, start, stop = self._pending
        return pack_range(ids, start, min(start + num_tokens, stop))

    def window(self, lo: int, hi: int) -> tuple[bytes, int]:
        """Tokens lo..hi of the edge, packed: (bytes, byte offset of token lo in them), for
        `bytes.startswith(query, offset)` (no copy when the edge is packed already).

        A short edge is packed whole on its first comparison: it will likely be compared
        again, and one pack costs less than a few windows.
        """
        if self._pending is not None:
            ids, start, stop = self._pending
            if stop - start > (_PACK_WHOLE_LIST if type(ids) is list else _PACK_WHOLE):
                return pack_range(ids, start + lo, min(start + hi, stop)), 0
            self.pack()
        return self._key, lo * ITEM_BYTES

    def cut(self, num_tokens: int) -> tuple[bytes | None, tuple | None]:
        """Drop the first `num_tokens` tokens from the edge; return them as (key, pending)
        for the node that takes them (packed only if this edge was)."""
        if self._key is not None:
            key, cut = self._key, num_tokens * ITEM_BYTES
            self._key = key[cut:]
            return key[:cut], None
        ids, start, stop = self._pending
        self._pending = (ids, start + num_tokens, stop)
        return None, (ids, start, start + num_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of the edge (pages are the caller's job)."""
        if self._key is not None:
            self._key = self._key[:num_tokens * ITEM_BYTES]
        else:
            ids, start, stop = self._pending
            self._pending = (ids, start, min(start + num_tokens, stop))

    @property
    def num_tokens(self) -> int:
        if self._key is not None:
            return len(self._key) // ITEM_BYTES
        return self._pending[2] - self._pending[1]

    @property
    def tokens(self) -> list[int]:
        """The edge's token ids (unpacked: for tests and introspection, not hot paths)."""
        return unpack(self.key)

    def __repr__(self) -> str:
        n = self.num_tokens
        head = unpack(self.head(4))
        more = "..." if n > 4 else ""
        return (f"TreeNode(id={self.id}, ns={self.namespace!r}, depth={self.depth}, "
                f"key={head}{more} ({n}), lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")
