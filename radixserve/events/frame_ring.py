"""FrameRing: the engine's frames to the publisher process through shared memory.

A byte ring in a shared mapping of a file in memory (child_process.memory_fd: no disk
writes back its dirty pages) whose descriptor the child inherits, as StatsBlock's. The
engine copies a frame in and advances `written`; the child, on its own timer, copies out
what lies between `read` and `written` and advances `read`. Each counter has one writer,
so no lock is shared. Why not the pipe it replaces: a ~40 KB frame written into a pipe
cost the engine's thread ~37 us of kernel time (the copy into pipe pages, and the child's
wake-up), which a copy into this mapping does in a few microseconds of its own, with no
syscall (docs/benchmarks.md, issue 37).

The bytes of a frame are stored before the counter that publishes them, and the child
reads the counter before the bytes: x86-64 keeps stores (and loads) in order, and a
lock's acquire and release, which Python has, is a full barrier on arm64 too (`_fence`).

A child that has had nothing to read for a while says it sleeps (`sleeping`), looks once
more for bytes, and waits on its stdin pipe; the engine, seeing the flag after a put,
writes one byte there (the doorbell: child_process.py). Each side stores its own word, a
barrier, then loads the other's, so at least one of them sees the other's store; the
child's wait also times out (child.py: a backstop), so a frame is at worst late, never
lost.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

__all__ = ["FrameRing"]

_Q = struct.Struct("<q")
# Each counter on its own cache line (one writer each: no false sharing).
_WRITTEN, _READ, _SLEEPING = 0, 64, 128
_LOCK = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock taken and let go)."""
    with _LOCK:
        pass


class FrameRing:
    def __init__(self, fd: int, size: int, create: bool):
        if size < 1:
            raise ValueError("the frame ring must hold at least one byte")
        if create:
            os.ftruncate(fd, mmap.PAGESIZE + size)
        self.size = size
        self._map = mmap.mmap(fd, mmap.PAGESIZE + size, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._data = memoryview(self._map)[mmap.PAGESIZE:]
        self._written = _Q.unpack_from(self._map, _WRITTEN)[0]   # this side's copies
        self._read = _Q.unpack_from(self._map, _READ)[0]

    # ------------------------------------------------------------ the engine's side
    def room(self) -> int:
        """Bytes `put` can take now (at least: the child may have read more since)."""
        return self.size - (self._written - _Q.unpack_from(self._map, _READ)[0])

    def put(self, data: bytes | bytearray | memoryview) -> None:
        """Copy `data` in (the caller checked `room`) and publish it."""
        n = len(data)
        at = self._written % self.size
        first = min(n, self.size - at)
        # Slices of a view: no copy but the one into the ring. Let go at once: the
        # engine's frame buffer is resized by its next encode.
        with memoryview(data) as view:
            self._data[at:at + first] = view[:first]
            if first < n:
                self._data[:n - first] = view[first:]
        _fence()
        self._written += n
        _Q.pack_into(self._map, _WRITTEN, self._written)
        _fence()                    # before the caller loads `sleeping`

    def child_sleeping(self) -> bool:
        return _Q.unpack_from(self._map, _SLEEPING)[0] != 0

    # ------------------------------------------------------------ the child's side
    def pending(self) -> int:
        """Bytes put and not taken yet."""
        return _Q.unpack_from(self._map, _WRITTEN)[0] - self._read

    def take(self) -> bytes:
        """Everything put since the last take (b"" if nothing), and room made for more."""
        end = _Q.unpack_from(self._map, _WRITTEN)[0]
        _fence()
        n = end - self._read
        if n <= 0:
            return b""
        at = self._read % self.size
        first = min(n, self.size - at)
        data = bytes(self._data[at:at + first])
        if first < n:
            data += self._data[:n - first]
        self._read = end
        _Q.pack_into(self._map, _READ, end)
        return data

    def set_sleeping(self, sleeping: bool) -> None:
        _Q.pack_into(self._map, _SLEEPING, int(sleeping))
        _fence()                    # before the caller loads `written` (pending)

    def close(self) -> None:
        self._data.release()
        self._map.close()
