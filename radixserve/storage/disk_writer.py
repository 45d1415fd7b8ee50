"""DiskWriter: the disk tier's page writes on a thread of their own, behind a bounded queue.

Writing a page file is a temporary file, an fsync and a rename (storage/atomic_files.py):
milliseconds per page, too slow for the step. The compute thread copies a demoted page's
bytes out of the pool (or host memory) and hands them here (`submit`); the writer thread
writes them in submission order and records each slot as written or failed. The engine's
thread, which owns the tree, collects those results (`take_finished`) and only then marks
the pages durable (cache/tiers.py: `LowerTiers.writes_finished`); the writer never touches
the tree. Until then a submitted page's bytes stay here (`held_page`), so a request that
needs the page meanwhile loads it from memory instead of recomputing it.

The queue is bounded in bytes (`max_bytes`, so that a page size of 1 does not make it a few
tokens long; `max_pages` can bound the count too): when it is full, `submit` drops the page (reported as a
failed write, counted in `faults` as queue_full) instead of waiting: a slow disk is never
waited on by the step, and never holds unbounded memory; the dropped page is recomputed
when needed. `drain` waits until every submitted page is written (saves, flushes and
shutdown call it).
"""

from __future__ import annotations

import logging
import queue
from typing import Protocol

from .disk_faults import DiskFaults
from .queue_worker import QueueWorker

__all__ = ["DiskWriter", "SlotWriter"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20    # bytes of pages waiting at most (SmolLM2-135M fp32: ~1,400 tokens)


class SlotWriter(Protocol):
    """Where pages go (storage/tier_pages.py: TierPages; `window`: a hybrid model's
    sliding-window KV of the page, written beside it)."""

    def write_page(self, slot: int, payload: bytes, window: bytes | None = None) -> None: ...


class DiskWriter(QueueWorker[tuple[int, bytes, bytes | None]]):
    """One daemon thread writing `(slot, payload, window)` pages into `target`, in order."""

    def __init__(self, target: SlotWriter, max_pages: int = 0,
                 faults: DiskFaults | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_pages < 0 or max_bytes < 1:
            raise ValueError("the writer's queue must hold at least one page")
        self.target = target
        self.max_bytes = max_bytes
        self._queued_bytes = 0          # payload bytes submitted and not yet taken up
        self.faults = faults if faults is not None else DiskFaults("(no store)")
        self.failed_writes = 0
        self._written: list[int] = []
        self._failed: list[int] = []
        self._held: dict[int, bytes] = {}      # slot -> its bytes until the tree hears back
        super().__init__("radixserve-disk-writer", max_pages)

    def submit(self, slot: int, payload: bytes, window: bytes | None = None) -> None:
        """Queue one page (and its window, a hybrid model's); never blocks: with the queue
        full, the page is dropped (the slot is reported failed by the next
        `take_finished`)."""
        if not self.alive:
            raise RuntimeError("the disk writer is closed")
        size = len(payload) + (len(window) if window is not None else 0)
        with self._lock:
            over = self._queued_bytes > 0 and self._queued_bytes + size > self.max_bytes
            if not over:
                self._held[slot] = payload
                self._queued_bytes += size
        try:
            if over:
                raise queue.Full
            self._queue.put_nowait((slot, payload, window))
        except queue.Full:
            self.faults.queue_full(self._queue.qsize())
            with self._lock:
                if not over:
                    self._queued_bytes -= size
                self._held.pop(slot, None)
                self._failed.append(slot)
                self.failed_writes += 1

    def held_page(self, slot: int) -> bytes | None:
        """A submitted page's bytes until `take_finished` reports it: the tree may load a
        page whose file is not durable yet from here (None: not submitted)."""
        with self._lock:
            return self._held.get(slot)

    def take_finished(self) -> tuple[list[int], list[int]]:
        """Slots written (durable) and slots whose write failed since the last call."""
        with self._lock:
            written, self._written = self._written, []
            failed, self._failed = self._failed, []
            for slot in (*written, *failed):
                self._held.pop(slot, None)
        return written, failed

    @property
    def queued_pages(self) -> int:
        return self._queue.qsize()

    def _handle(self, item: tuple[int, bytes, bytes | None]) -> None:
        slot, payload, window = item
        with self._lock:
            self._queued_bytes -= len(payload) + (len(window) if window is not None else 0)
        try:
            if window is None:
                self.target.write_page(slot, payload)
            else:
                self.target.write_page(slot, payload, window)
        except Exception as e:      # full, refused, I/O: the page is not demoted
            with self._lock:
                self._failed.append(slot)
                self.failed_writes += 1
                first = self.failed_writes == 1
            if first and not isinstance(e, OSError):     # the store logs OSErrors by kind
                log.warning("disk tier: a page write failed (%s: %s); such pages are dropped "
                            "and recomputed when needed", type(e).__name__, e)
            return
        with self._lock:
            self._written.append(slot)
