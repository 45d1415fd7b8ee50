"""Token keys: token ids packed as native-endian int64 bytes, the form the radix tree stores.

Why bytes: the tree compares every request's tokens with edges of thousands of tokens. Two
2,000-token Python lists compare in ~3.5 us (a pointer walk and an int compare per item,
~8 ns per item when the ints are distinct objects, as a tokenizer makes them); the same
tokens as bytes compare with memcmp in ~0.2 us, and `key.startswith(edge, offset)` tests an
edge at an offset without slicing anything. int64 holds any token id, the replay tool's
negative page marks and synthetic ids beyond 2**32 included.

Callers that keep their tokens in an `array('q')` (the engine does) or an int64 numpy array
(the replay tool does) pay a memcpy per call; a list costs ~5 ns per token to pack.
"""

from __future__ import annotations

import sys
from array import array
from typing import Sequence, Union

import numpy as np

__all__ = ["ITEM_BYTES", "TYPECODE", "TokenIds", "count", "new_token_array", "pack",
           "token_at", "unpack"]

TYPECODE = "q"                  # array typecode of a packed key: signed 64-bit
ITEM_BYTES = 8
_INT64 = np.dtype(np.int64)
_BYTEORDER = sys.byteorder

TokenIds = Union[Sequence[int], bytes, np.ndarray, array]


def new_token_array(tokens: Sequence[int] = ()) -> array:
    """A growable token list in the packed layout: appends are O(1), packing is a memcpy."""
    return array(TYPECODE, tokens)


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
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a {tokens.dtype} array")
        return tokens[start:].astype(_INT64, copy=False).tobytes()
    return array(TYPECODE, tokens[start:] if start else tokens).tobytes()


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
