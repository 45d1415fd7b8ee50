"""Token keys: token ids packed as native-endian int64 bytes, the form the radix tree stores.

Why bytes: the tree compares every request's tokens with edges of thousands of tokens. Two
2,000-token Python lists compare in ~3.5 us (a pointer walk and an int compare per item,
~8 ns per item when the ints are distinct objects, as a tokenizer makes them); the same
tokens as bytes compare with memcmp in ~0.2 us, and `edge.startswith(view[a:b], offset)`
tests a slice of a request's ids against an edge without copying either (a memoryview slice
copies nothing; comparing two memoryviews would go item by item, so the edge side is bytes). int64 holds any token id, the replay tool's
negative page marks and synthetic ids beyond 2**32 included.

Callers that keep their tokens in an `array('q')` (the engine does) or an int64 numpy array
(the replay tool does) pay nothing: the tree reads their buffer in place (`byte_view`). A
list costs ~5-15 ns per token to pack, and a walk down the tree packs it only as far as it
reads (`LazyKey`): a miss on a 12k-token prompt packs 64 tokens, not the whole prompt.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Sequence, Union

import numpy as np

__all__ = ["ITEM_BYTES", "LazyKey", "TYPECODE", "TokenIds", "byte_view", "count",
           "new_token_array", "pack", "pack_range", "prefix", "TokenPrefix", "token_at", "unpack"]

TYPECODE = "q"                  # array typecode of a packed key: signed 64-bit
ITEM_BYTES = 8
_INT64 = np.dtype(np.int64)
_BYTEORDER = sys.byteorder

TokenIds = Union[Sequence[int], bytes, np.ndarray, array, memoryview]
TokenRange = tuple  # (a list of ids, start, stop): ids[start:stop], read later


def new_token_array(tokens: Sequence[int] = ()) -> array:
    """A growable token list in the packed layout: appends are O(1), packing is a memcpy."""
    return array(TYPECODE, tokens)


class TokenPrefix:
    """tokens[:n] without a copy: the first `n` ids of a sequence that may grow later."""

    __slots__ = ("tokens", "n")

    def __init__(self, tokens: TokenIds, n: int):
        self.tokens = tokens
        self.n = n

    def __len__(self) -> int:
        return self.n


def prefix(tokens: TokenIds, n: int) -> TokenIds:
    """The first `n` ids of `tokens`, without copying them."""
    if type(tokens) is bytes:
        return tokens[:n * ITEM_BYTES] if n * ITEM_BYTES < len(tokens) else tokens
    if n >= len(tokens):
        return tokens
    return TokenPrefix(tokens, n)


def count(tokens: TokenIds) -> int:
    """How many token ids `tokens` holds (packed or not)."""
    if type(tokens) is bytes:
        return len(tokens) // ITEM_BYTES
    return len(tokens)


def pack(tokens: TokenIds, start: int = 0) -> bytes:
    """The packed key of tokens[start:]; bytes are taken to be packed already (and checked)."""
    if type(tokens) is bytes:
        if len(tokens) % ITEM_BYTES:
            raise ValueError(f"a packed token key has a multiple of {ITEM_BYTES} bytes, "
                             f"got {len(tokens)}")
        return tokens[start * ITEM_BYTES:] if start else tokens
    if type(tokens) is array and tokens.typecode == TYPECODE:
        return memoryview(tokens)[start:].tobytes() if start else tokens.tobytes()
    if type(tokens) is memoryview and tokens.format == TYPECODE:
        return tokens[start:].tobytes()
    if type(tokens) is TokenPrefix:
        return pack_range(tokens.tokens, start, tokens.n)
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a {tokens.dtype} array")
        return tokens[start:].astype(_INT64, copy=False).tobytes()
    return _pack_list(tokens[start:] if start else tokens)


def pack_range(tokens: TokenIds, start: int, stop: int) -> bytes:
    """The packed key of tokens[start:stop] (copies only that range)."""
    if type(tokens) is bytes:
        if len(tokens) % ITEM_BYTES:
            raise ValueError(f"a packed token key has a multiple of {ITEM_BYTES} bytes, "
                             f"got {len(tokens)}")
        if start == 0 and stop * ITEM_BYTES >= len(tokens):
            return tokens
        return tokens[start * ITEM_BYTES:stop * ITEM_BYTES]
    if type(tokens) is array and tokens.typecode == TYPECODE:
        return memoryview(tokens)[start:stop].tobytes()
    if type(tokens) is TokenPrefix:
        return pack_range(tokens.tokens, start, min(stop, tokens.n))
    if type(tokens) is memoryview and tokens.format == TYPECODE:
        return tokens[start:stop].tobytes()
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a {tokens.dtype} array")
        return tokens[start:stop].astype(_INT64, copy=False).tobytes()
    return _pack_list(tokens[start:stop])


def _pack_list(tokens: Sequence[int]) -> bytes:
    """Python ints -> int64 bytes: struct is ~2.5x faster than array('q', list)."""
    n = len(tokens)
    fmt = _structs.get(n)
    if fmt is None:
        fmt = struct.Struct(f"={n}q")
        if len(_structs) < 4096:
            _structs[n] = fmt
    try:
        return fmt.pack(*tokens)
    except struct.error as exc:         # not ints, or beyond int64: say it like array does
        raise TypeError(f"token ids must be int64 integers: {exc}") from None


_structs: dict[int, struct.Struct] = {}
# Sequences an edge may keep a reference to instead of a packed copy: the caller never
# changes ids already inserted (it may append).
_KEEPABLE = (list, array, np.ndarray, bytes)
_NO_BYTES = memoryview(b"")


def byte_view(tokens: TokenIds) -> memoryview | None:
    """A zero-copy byte view of ids already in the packed layout (bytes, an `array('q')`, a
    C-contiguous native int64 numpy array or 'q' memoryview), else None (they must be packed).

    The view exports the caller's buffer: an `array('q')` cannot be resized while the view
    lives, so the tree holds such views only for the duration of one call.
    """
    kind = type(tokens)
    if kind is array:
        return memoryview(tokens).cast("B") if tokens.typecode == TYPECODE else None
    if kind is bytes:
        if len(tokens) % ITEM_BYTES:
            raise ValueError(f"a packed token key has a multiple of {ITEM_BYTES} bytes, "
                             f"got {len(tokens)}")
        return memoryview(tokens)
    if kind is np.ndarray:
        if tokens.dtype == _INT64 and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return memoryview(tokens).cast("B")
        return None
    if kind is memoryview and tokens.format == TYPECODE and tokens.c_contiguous:
        return tokens.cast("B")
    return None


class LazyKey:
    """The packed key of tokens[start:start + num_tokens], as a byte memoryview (`buf`).

    Ids already in the packed layout (`array('q')`, int64 numpy, bytes) are not copied at
    all: `buf` is a view of the caller's buffer, whole from the start. Others (lists, other
    dtypes) are packed only as far as they are read: `upto(end_b)` returns a view holding
    at least the first `end_b` bytes of the key (byte offsets are relative to `start`),
    re-packing a prefix at least four times as long as the last one (or the whole key once
    that is past half of it), so reading k tokens in any number of steps packs fewer than
    2k + FIRST. `buf` is always a memoryview, so slicing it copies nothing; compare a slice
    of it with `some_bytes.startswith(buf[a:b], offset)` (memcmp).
    """

    __slots__ = ("tokens", "start", "num_bytes", "buf", "zero_copy")
    FIRST = 64                  # tokens packed by the first read (a child lookup or more)

    def __init__(self, tokens: TokenIds, start: int, num_tokens: int):
        if type(tokens) is TokenPrefix:         # num_tokens never reaches past its n
            tokens = tokens.tokens
        self.tokens = tokens
        self.start = start
        self.num_bytes = n = num_tokens * ITEM_BYTES
        view = byte_view(tokens)
        self.zero_copy = view is not None
        if view is None:
            self.buf = _NO_BYTES
        elif start or len(view) != n:
            first = start * ITEM_BYTES
            self.buf = view[first:first + n]
        else:
            self.buf = view

    def upto(self, end_b: int) -> memoryview:
        buf = self.buf
        if len(buf) >= end_b:
            return buf
        want = max(end_b, 4 * len(buf), self.FIRST * ITEM_BYTES)
        if 2 * want > self.num_bytes:
            want = self.num_bytes
        packed = pack_range(self.tokens, self.start, self.start + want // ITEM_BYTES)
        self.buf = buf = memoryview(packed)
        return buf

    def edge_from(self, pos_b: int) -> tuple[bytes | None, TokenRange | None]:
        """The key from byte offset `pos_b` on, for a new edge: packed bytes, or the
        caller's ids and their range, to pack on first read (see TreeNode). Ids that need no
        packing, or are not packed that far yet, are kept as a reference: copying a list of
        ints, even into a tuple, touches every int object (refcounts): ~10 ns per token on
        a 12k-token prompt, as much as packing."""
        tokens = self.tokens
        if type(tokens) in _KEEPABLE and (self.zero_copy or len(self.buf) < self.num_bytes):
            first = self.start + pos_b // ITEM_BYTES
            return None, (tokens, first, self.start + self.num_bytes // ITEM_BYTES)
        return self.tail(pos_b), None

    def tail(self, pos_b: int) -> bytes:
        """The key from byte offset `pos_b` to its end, as bytes."""
        buf = self.buf
        if len(buf) == self.num_bytes:
            whole = buf.obj
            if not pos_b and type(whole) is bytes and len(whole) == self.num_bytes:
                return whole
            return buf[pos_b:].tobytes()
        first = self.start + pos_b // ITEM_BYTES
        return pack_range(self.tokens, first, self.start + self.num_bytes // ITEM_BYTES)


def unpack(key: bytes) -> list[int]:
    """The token ids of a packed key."""
    out = array(TYPECODE)
    out.frombytes(key)
    return out.tolist()


def token_at(key: bytes, index: int) -> int:
    """One token of a packed key (negative indices count from the end)."""
    n = len(key) // ITEM_BYTES
    if index < 0:
        index += n
    if not 0 <= index < n:
        raise IndexError(f"token {index} of a {n}-token key")
    start = index * ITEM_BYTES
    return int.from_bytes(key[start:start + ITEM_BYTES], _BYTEORDER, signed=True)
