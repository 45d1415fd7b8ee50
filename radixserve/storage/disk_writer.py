"""DiskWriter: the disk tier's page writes on a thread of their own, behind a bounded queue.

Writing a page file is a temporary file, an fsync and a rename (storage/atomic_files.py):
milliseconds per page, too slow for the step. The compute thread copies a demoted page's
bytes out of the pool (or host memory) and hands them here (`submit`); the writer thread
writes them in submission order and records each slot as written or failed. The engine's
thread, which owns the tree, collects those results (`take_finished`) and only then marks
the pages durable (cache/tiers.py: `LowerTiers.writes_finished`); the writer never touches
the tree. Until then a submitted page's bytes stay here (`held_page`), so a request that
needs the page meanwhile loads it from memory instead of recomputing it.

The queue is bounded: when `max_pages` pages wait, `submit` blocks, so a step that demotes
faster than the disk writes waits for it (back-pressure) instead of dropping pages or
holding unbounded memory. `drain` waits until every submitted page is written (saves,
flushes and shutdown call it).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

__all__ = ["DiskWriter", "SlotWriter"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PAGES = 64          # pages waiting at most (SmolLM2-135M fp32, 16-token pages: 46 MiB)


class SlotWriter(Protocol):
    """Where pages go (storage/tier_pages.py: TierPages)."""

    def write_page(self, slot: int, payload: bytes) -> None: ...


class DiskWriter:
    """One daemon thread writing `(slot, payload)` pages into `target`, in order."""

    def __init__(self, target: SlotWriter, max_pages: int = DEFAULT_MAX_PAGES):
        if max_pages < 1:
            raise ValueError("the writer's queue must hold at least one page")
        self.target = target
        self.failed_writes = 0
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(max_pages)
        self._lock = threading.Lock()
        self._written: list[int] = []
        self._failed: list[int] = []
        self._held: dict[int, bytes] = {}      # slot -> its bytes until the tree hears back
        self._thread = threading.Thread(target=self._run, name="radixserve-disk-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, slot: int, payload: bytes) -> None:
        """Queue one page; blocks while the queue is full (back-pressure on the step)."""
        if not self._thread.is_alive():
            raise RuntimeError("the disk writer is closed")
        with self._lock:
            self._held[slot] = payload
        self._queue.put((slot, payload))

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

    def drain(self) -> None:
        """Wait until every page submitted so far is written or has failed."""
        self._queue.join()

    @property
    def queued_pages(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, slot: int, payload: bytes) -> None:
        try:
            self.target.write_page(slot, payload)
        except Exception as e:      # full, refused, I/O: the page is not demoted
            with self._lock:
                self._failed.append(slot)
                self.failed_writes += 1
                first = self.failed_writes == 1
            if first:
                log.warning("disk tier: a page write failed (%s: %s); such pages are dropped "
                            "and recomputed when needed", type(e).__name__, e)
            return
        with self._lock:
            self._written.append(slot)
