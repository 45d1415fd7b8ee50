"""DiskReader: the disk tier's page reads (file read + CRC32C check) on a thread of their own.

A request whose cached prefix continues on disk needs those pages before its prefill. The
event-loop thread that admits it must not block on file I/O, so admission asks for the
pages (`request`) and the request waits in the queue; this thread reads and checks them;
the next admission finds them (`take`) and loads them like host pages (cache/tiers.py:
`LowerTiers.plan_load`). A page that is missing or fails its check comes back as None: the
load ends there and the rest of the prefix is recomputed.

Results are by disk-tier slot. The tree never reuses a slot while its read is in flight or
its result waits (it holds such slots as `orphaned` until `discard`), so a result always
belongs to the page the slot held when it was asked for.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

__all__ = ["DiskReader", "SlotReader"]

class SlotReader(Protocol):
    """Where pages come from (storage/tier_pages.py: TierPages)."""

    def read_page(self, slot: int) -> bytes | None: ...


class DiskReader:
    """One daemon thread reading requested slots from `source`, in request order."""

    def __init__(self, source: SlotReader):
        self.source = source
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._lock = threading.Lock()
        self._asked: set[int] = set()           # requested, not yet read
        self._results: dict[int, bytes | None] = {}
        self._finished: list[int] = []          # read since the last take_finished
        self._pages = 0
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="radixserve-disk-reader",
                                        daemon=True)
        self._thread.start()

    def request(self, slots: list[int]) -> None:
        """Read these slots (those already asked for or read are not read again)."""
        with self._lock:
            new = [s for s in slots if s not in self._asked and s not in self._results]
            self._asked.update(new)
        for slot in new:
            self._queue.put(slot)

    def asked(self, slot: int) -> bool:
        """Requested or read, and not discarded."""
        with self._lock:
            return slot in self._asked or slot in self._results

    def ready(self, slot: int) -> bool:
        with self._lock:
            return slot in self._results

    def take(self, slot: int) -> bytes | None:
        """A read slot's bytes (None: missing or corrupt); the result is forgotten."""
        with self._lock:
            return self._results.pop(slot)

    def take_finished(self) -> list[int]:
        """Slots whose read ended since the last call (their results wait in `take`)."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def discard(self, slot: int) -> None:
        """Forget a slot's result (its node left the disk tier)."""
        with self._lock:
            self._results.pop(slot, None)

    def take_timing(self) -> tuple[int, float]:
        """Pages read and the seconds they took, since the last call."""
        with self._lock:
            pages, seconds = self._pages, self._seconds
            self._pages, self._seconds = 0, 0.0
        return pages, seconds

    def drain(self) -> None:
        """Wait until every requested read has ended."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            slot = self._queue.get()
            try:
                if slot is None:
                    return
                started = time.perf_counter()
                try:
                    data = self.source.read_page(slot)
                except Exception:       # an I/O error reads as a missing page
                    data = None
                elapsed = time.perf_counter() - started
                with self._lock:
                    self._asked.discard(slot)
                    self._results[slot] = data
                    self._finished.append(slot)
                    self._pages += 1
                    self._seconds += elapsed
            finally:
                self._queue.task_done()
