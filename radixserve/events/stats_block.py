"""StatsBlock: the publisher process's counters, shared with the engine through memory.

A few 8-byte slots in a shared mapping of a file in memory (child_process.memory_fd)
whose descriptor the child inherits (process_publisher.py): the child writes its counters
after each batch, the engine reads them when asked (/metrics, wait_idle) with no message,
no thread and no syscall. Only the child writes, all slots at once after each batch; a
reader may see some slots of the newer write and others of the older: harmless, as every
count only grows (a waiter reads again). Slots are 8-byte aligned, which x86-64 and
arm64 copy whole.
"""

from __future__ import annotations

import mmap
import os
import struct

__all__ = ["FIELDS", "StatsBlock"]

# The slots, in order; cpu_s is a double, the others are counts.
# wakes: the child's voluntary context switches, its threads' (each a sleep it woke from).
FIELDS = ("handled_frames", "published_batches", "published_bytes", "replay_requests",
          "bad_replay_requests", "failed_batches", "cpu_s", "wakes")
_LAYOUT = struct.Struct("<6qdq")
# Each slot's (format, offset), for `get`.
_SLOTS = {name: (struct.Struct("<d" if name == "cpu_s" else "<q"), 8 * i)
          for i, name in enumerate(FIELDS)}


class StatsBlock:
    def __init__(self, fd: int, create: bool):
        if create:
            os.ftruncate(fd, mmap.PAGESIZE)
        self._map = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)

    def write(self, values: tuple) -> None:
        """(Child) the counters, in FIELDS' order."""
        _LAYOUT.pack_into(self._map, 0, *values)

    def read(self) -> dict[str, float]:
        return dict(zip(FIELDS, _LAYOUT.unpack_from(self._map, 0)))

    def get(self, name: str) -> float:
        """One slot (the engine's checks per step read one, not all)."""
        slot, at = _SLOTS[name]
        return slot.unpack_from(self._map, at)[0]

    def close(self) -> None:
        self._map.close()
