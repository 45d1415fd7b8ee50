"""file_sha256: a file's sha256, computed once per process for an unchanged file.

The weights cache keys its entries by the GGUF's sha256, and the KV disk store's model
fingerprint names the weights by the same hash: memoizing it by the file's identity
(path, inode, size, mtime) lets both ask without reading the file twice at start-up.
Torch-free, so the disk store can use it. `modules_digest`: a digest of some modules'
source, for caches whose entries the code that made them decides (weights, compiled steps).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from functools import lru_cache
from pathlib import Path


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of the file's bytes (recomputed when the file changed)."""
    st = os.stat(path)
    return _sha256_of(str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns,
                      chunk_bytes)


@lru_cache(maxsize=64)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int, chunk_bytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)              # releases the GIL: other threads run
    return digest.hexdigest()


def modules_digest(names: tuple[str, ...], seed: bytes = b"") -> str:
    """16 hex digits of sha256 over `seed` and the named modules' source files: editing
    one of them retires what a cache keyed by it holds."""
    digest = hashlib.sha256(seed)
    for name in names:
        module = sys.modules.get(name) or importlib.import_module(name)
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]
