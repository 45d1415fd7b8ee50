"""StoredWindows: the window files of disk-tier pages, read back when a match needs them.

The disk tier writes a hybrid model's page with its sliding-window KV beside it, as a file
of its own (storage/tier_pages.py), and a restart restores the nodes. But the windowed pool
holds a disk node's window only while it has room: a restart reads back only as many as
are free, and a short windowed pool drops demoted nodes' windows first
(WindowedMemory._window_room). Without its window a match point is unusable, and the match
backs off though the bytes are on disk. So a match whose lower part reaches a point whose
windows are on disk (`stored`) reads those files (`load`: checked by the store; a file that
fails counts as missing), gives each a windowed page and queues a `WindowLoad` order that
writes them into the windowed pool. The order goes into the tiers' one ordered list, so a
windowed page freed and handed out again is read by every earlier order (a disk write of
the window it held: DemoteOrder.windows) before this one writes it.

The files are read on the tree's thread, when the match is made: a few small files per
match (only match points keep windows), where the full pages' reads use the reader thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .page_allocator import OutOfPages
from .tiers import DISK, LowerTiers

if TYPE_CHECKING:
    from .window_memory import WindowedMemory

__all__ = ["StoredWindows", "WindowFiles", "WindowLoad"]


class WindowFiles(Protocol):
    """The disk tier's window files, by disk slot (storage/tier_pages.py: TierPages)."""

    def has_window(self, slot: int) -> bool: ...

    def read_window(self, slot: int) -> bytes | None:
        """Its bytes, checked; None when missing or failing its check."""


@dataclass(frozen=True, slots=True)
class WindowLoad:
    """Write `payloads` into windowed pool pages `pages` (run in order with the tier
    moves: attention/kv_tiers.py)."""

    pages: np.ndarray
    payloads: tuple[bytes, ...]


class StoredWindows:
    def __init__(self, memory: WindowedMemory, tiers: LowerTiers, files: WindowFiles,
                 payload_bytes: int):
        self.memory = memory
        self.tiers = tiers
        self.files = files
        self.payload_bytes = payload_bytes      # one windowed page's (another length: skipped)
        self.loaded = 0             # windows read back from their files

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """Disk slot of each tree id (-1: not a disk id)."""
        ids = np.asarray(ids, dtype=np.int64)
        off = self.tiers.offset[DISK]
        slots = ids - off
        slots[(ids < off) | (slots >= self.tiers.alloc[DISK].num_pages)] = -1
        return slots

    def stored(self, ids: np.ndarray) -> np.ndarray:
        """bool per tree id: a disk id whose window is not in the pool but in a file."""
        slots = self._slots(ids)
        out = np.zeros(len(slots), dtype=bool)
        for i in np.flatnonzero((slots >= 0) & ~self.memory.windows.present(ids)).tolist():
            out[i] = self.files.has_window(int(slots[i]))
        return out

    def load(self, ids: np.ndarray) -> int:
        """Read the windows of `ids` (disk ids with a stored window only), attach them and
        queue their writes; -> how many (a file failing its check, or no room in the
        windowed pool, leaves its id without one)."""
        ids = [int(i) for i in np.asarray(ids).tolist()]
        got = [(i, self.files.read_window(int(s))) for i, s in zip(ids, self._slots(ids))]
        got = [(i, payload) for i, payload in got
               if payload is not None and len(payload) == self.payload_bytes]
        if not got:
            return 0
        try:
            self.memory.make_window_room(len(got))
        except OutOfPages:              # running requests hold the windowed pool
            return 0
        pages = self.memory.windows.attach_lower([i for i, _ in got])
        self.tiers.queue(WindowLoad(pages, tuple(p for _, p in got)))
        self.loaded += len(got)
        return len(got)
