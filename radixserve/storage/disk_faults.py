"""DiskFaults: what went wrong with one KV disk directory, and whether to write to it now.

A disk tier is a cache: a full disk, a directory turned read-only, an I/O error or a failed
fsync must never fail a request. The store reports each `OSError` here instead of raising
it to the engine; this counts it by kind (for `/metrics`), logs the first of each kind with
its path (a full disk fails every write: one line, not thousands), and pauses writes: for
`retry_s` after a write fault, writes are refused without touching the disk (the page is
dropped and recomputed when needed). The first write after that probes the disk; if it
succeeds (space freed, directory writable again), writes resume and that is logged too.
Reads are not paused: a page that cannot be read is dropped by the store, alone.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Callable

__all__ = ["DiskFaults", "FsyncFailed", "WritesPaused", "FAULT_KINDS", "write_fault_kind"]

log = logging.getLogger(__name__)

FAULT_KINDS = ("no_space", "read_only", "write_error", "fsync_error", "read_error",
               "queue_full")
DEFAULT_RETRY_S = 1.0
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class FsyncFailed(OSError):
    """An fsync that failed: the data may not be on disk (atomic_files.py raises it)."""


class WritesPaused(OSError):
    """A write refused without trying: the directory failed recently (see DiskFaults)."""


def write_fault_kind(exc: OSError) -> str:
    if isinstance(exc, FsyncFailed):
        return "fsync_error"
    if exc.errno in _NO_SPACE:
        return "no_space"
    if exc.errno in _READ_ONLY:
        return "read_only"
    return "write_error"


class DiskFaults:
    """Thread-safe: the writer, the reader and the engine's thread report here."""

    def __init__(self, directory: str, retry_s: float = DEFAULT_RETRY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.directory = directory
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(FAULT_KINDS, 0)
        self.skipped_writes = 0             # refused while paused (the disk not touched)
        self.paused_kind: str | None = None  # the fault that paused writes, None: writing
        self._retry_at = 0.0
        self._logged: set[str] = set()

    def may_write(self) -> bool:
        """Whether to try a write now: not paused, or paused long enough to probe again."""
        with self._lock:
            if self.paused_kind is None or self._clock() >= self._retry_at:
                return True
            self.skipped_writes += 1
            return False

    def write_failed(self, exc: OSError, path: object) -> str:
        """A write (or a removal) failed: count it, log its kind once, pause writes."""
        kind = write_fault_kind(exc)
        with self._lock:
            self.paused_kind = kind
            self._retry_at = self._clock() + self.retry_s
        self._count(kind, path, exc, "writes paused, retried every "
                                     f"{self.retry_s:g} s; pages are recomputed meanwhile")
        return kind

    def write_ok(self) -> None:
        """A write succeeded: if writes were paused, the condition cleared."""
        with self._lock:
            was, self.paused_kind = self.paused_kind, None
        if was is not None:
            log.warning("KV disk store %s: writes resumed (the %s condition cleared)",
                        self.directory, was)

    def read_failed(self, exc: OSError, path: object) -> None:
        self._count("read_error", path, exc, "the page is dropped and recomputed")

    def queue_full(self, pending: int) -> None:
        self._count("queue_full", self.directory, f"{pending} pages already wait",
                    "the disk is slower than demotion: such pages are dropped, not waited on")

    def _count(self, kind: str, path: object, what: object, consequence: str) -> None:
        with self._lock:
            self.counts[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("KV disk store: %s at %s (%s); %s", kind, path, what, consequence)

    def as_dict(self) -> dict:
        with self._lock:
            return {"faults": dict(self.counts), "skipped_writes": self.skipped_writes,
                    "writes_paused": self.paused_kind}
