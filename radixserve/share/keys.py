"""What a shared page is called: its path hash, scoped to one model configuration.

A page's path hash (cache/path_hash.py, block = page) already names its namespace and every
token before it. The scope adds what else the bytes depend on: the model fingerprint
(weights, dtype, page size, KV layout and dtype, the K/V code: storage/fingerprint.py). Two
replicas with different weights or KV formats therefore never see each other's pages: the
key differs, and every loaded page is checked against its key (framing.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec

from radixserve.storage.fingerprint import ModelFingerprint

__all__ = ["KEY_BYTES", "ShareScope", "entry_key"]

KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class ShareScope:
    """The model configuration a page belongs to, as a short digest."""

    digest: bytes

    @classmethod
    def of(cls, fingerprint: ModelFingerprint) -> "ShareScope":
        data = msgspec.json.encode(fingerprint)
        return cls(hashlib.blake2b(data, digest_size=KEY_BYTES).digest())


def entry_key(scope: ShareScope, path_hash: bytes) -> bytes:
    """The store's key of one page: its path hash within `scope` (16 bytes)."""
    return hashlib.blake2b(path_hash, key=scope.digest, digest_size=KEY_BYTES).digest()
