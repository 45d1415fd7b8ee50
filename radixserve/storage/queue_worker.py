"""QueueWorker: one daemon thread that handles queued items in order, for the disk tier.

The disk writer and reader (disk_writer.py, disk_reader.py) differ only in what they do
with an item; the thread, the queue, `drain` (wait for everything queued so far) and
`close` (finish what is queued, then stop) live here once; both can be bounded in time, so
a thread stuck in a call that never returns (a hung shared store) cannot hold a shutdown.
"""

from __future__ import annotations

import queue
import threading
from typing import Generic, TypeVar

__all__ = ["QueueWorker"]

Item = TypeVar("Item")


class QueueWorker(Generic[Item]):
    """Subclasses implement `_handle(item)`; `_put` queues an item (blocking when full)."""

    def __init__(self, name: str, max_items: int = 0):
        self._queue: queue.Queue[Item | None] = queue.Queue(max_items)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _handle(self, item: Item) -> None:
        raise NotImplementedError

    def _put(self, item: Item) -> None:
        self._queue.put(item)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every item queued so far is handled (False: `timeout` seconds
        passed first, e.g. the thread is stuck in one)."""
        if timeout is None:
            self._queue.join()
            return True
        if not self._thread.is_alive():
            return self._queue.empty()
        handled = threading.Event()         # queued behind everything so far
        self._queue.put(handled)
        return handled.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Handle what is queued, then stop the thread. With `timeout`, wait that long at
        most (False: the thread is still in an item; it is a daemon, so it does not keep
        the process alive, and it stops after what is queued)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, threading.Event):       # drain(timeout)'s marker
                    item.set()
                    continue
                self._handle(item)
            finally:
                self._queue.task_done()
