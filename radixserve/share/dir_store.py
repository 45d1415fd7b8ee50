"""DirSharedStore: shared pages as files in one directory (`--kv-share dir:PATH`).

For replicas on one host (a local disk) or on many (NFS, Lustre). Each page is one file
named by its entry key, holding the framed page (framing.py: CRC32C and the key). Several
processes may publish and read at once:
- a publish writes a temporary file of its own (unique name) and renames it over the
  final name: a reader sees no file or a complete one, never a half-written one; two
  replicas publishing the same page at once both rename a complete, equal file, and the
  last rename wins;
- a read that races an eviction finds no file (a miss) or reads the complete file it
  opened (POSIX keeps an unlinked file readable);
- a file whose CRC or key does not match (corrupt, truncated, another configuration's
  page renamed into place) is refused and removed; the caller recomputes.
No fsync: a shared page is a copy of what a replica can compute again, so a power loss
that loses some costs only recompute (CRC refuses a torn one).

Claims (pages a replica is computing, not yet published: dir_claims.py) are `.claim` files
in the same directory.

Bounded by `capacity_bytes`: past it, the publisher that notices removes the least recently
used files (a read refreshes a file's mtime) down to 90% of the bound.

What dead replicas leave is swept when a store opens and at every eviction scan: expired
claim files (dir_claims.py) and temporary files older than `STALE_TMP_S` (a publish writes
one in milliseconds; an old one is a killed publisher's).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Sequence

from .dir_claims import DirClaims
from .framing import frame
from .store import Claim, Fetched, ShareCounters

__all__ = ["DirSharedStore"]

SUFFIX = ".kvpage"
TMP_MARK = ".tmp-"
LOW_WATER = 0.9
STALE_TMP_S = 600.0


class DirSharedStore:
    name = "dir"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int):
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.counters = ShareCounters()
        self._lock = threading.Lock()
        self._added_since_scan = 0      # bytes this process added since its last size scan
        self._scanned_bytes = self._scan_total()
        self.claims = DirClaims(self.root)
        self.sweep()

    def _path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}{SUFFIX}"

    # ------------------------------------------------------------------ publish
    def publish(self, key: bytes, payload: bytes) -> bool:
        path = self._path(key)
        if path.exists():
            self.counters.duplicate_pages += 1
            return False
        blob = frame(key, payload)
        tmp = self.root / f"{path.name}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        with self._lock:
            self.counters.published_pages += 1
            self.counters.bytes_published += len(blob)
            self._added_since_scan += len(blob)
            over = self._scanned_bytes + self._added_since_scan > self.capacity_bytes
        if over:
            self.evict()
        return True

    def publish_many(self, keys: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        return sum(self.publish(k, p) for k, p in zip(keys, payloads))

    # ------------------------------------------------------------------ look up
    def published(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if not self._path(key).exists():
                break
            n += 1
        return n

    def fetch(self, keys: Sequence[bytes]) -> Fetched:
        got = Fetched()
        for key in keys:
            path = self._path(key)
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                got.lost += 1
                break
            if not got.add(key, blob):
                path.unlink(missing_ok=True)        # never served again
                break
            try:
                os.utime(path)                      # recently used: evicted last
            except OSError:
                pass
        with self._lock:
            self.counters.add_fetch(got)
        return got

    # ------------------------------------------------------------------ claims
    def claim(self, keys: Sequence[bytes], owner: str, ttl_s: float) -> Claim:
        return self.claims.claim(keys, owner, ttl_s)

    def release_claims(self, keys: Sequence[bytes], owner: str) -> None:
        self.claims.release(keys, owner)

    # ------------------------------------------------------------------ bound
    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def sweep(self) -> int:
        """Remove expired claims and stale temporary files (dead replicas' leftovers);
        returns how many files went."""
        removed = self.claims.sweep()
        old = time.time() - STALE_TMP_S
        for entry in os.scandir(self.root):
            if TMP_MARK not in entry.name:
                continue
            try:
                if entry.stat().st_mtime < old:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def evict(self) -> int:
        """Remove least recently used pages until the directory holds at most 90% of its
        bound (every process's pages count). Returns the pages removed."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        target = int(self.capacity_bytes * LOW_WATER)
        removed = 0
        for _, size, path in entries:
            if total <= target:
                break
            path.unlink(missing_ok=True)
            total -= size
            removed += 1
        with self._lock:
            self._scanned_bytes, self._added_since_scan = total, 0
            self.counters.forgotten_pages += removed
        self.sweep()
        return removed

    def used_bytes(self) -> int:
        return self._scan_total()

    def close(self) -> None:
        """Nothing held open (stray temporary files of a killed publisher are harmless)."""
