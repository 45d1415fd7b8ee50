"""CrashPoints: kill -9 this process at a named moment of a disk operation (a test hook).

The crash tests must stop a server mid-write, mid-journal-append, mid-compaction or
mid-load deterministically, not by guessing a delay. `RADIXSERVE_CRASH_AT="point:n"` makes
the n-th arrival at `point` send SIGKILL to the process itself (nothing runs after it, as
with an OOM kill). Points: `page_write` (a page file written, before its rename),
`journal_append` (half a record written), `compaction` (the compacted index written,
before the old journal files are removed), `load` (a page read for a load, before it is
used). Unset (every server): `reached` is one comparison.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["CrashPoints", "CRASH_ENV", "POINTS"]

CRASH_ENV = "RADIXSERVE_CRASH_AT"
POINTS = ("page_write", "journal_append", "compaction", "load")


class CrashPoints:
    def __init__(self, spec: str | None = None):
        self.point: str | None = None
        self.at = 0
        self._count = 0
        self._lock = threading.Lock()
        if spec:
            point, _, n = spec.partition(":")
            if point not in POINTS:
                raise ValueError(f"{CRASH_ENV}: unknown point {point!r} (one of {POINTS})")
            self.point, self.at = point, int(n or 1)

    @classmethod
    def from_env(cls) -> "CrashPoints":
        return cls(os.environ.get(CRASH_ENV))

    def armed(self, point: str) -> bool:
        """Count an arrival at `point`; True when it is the one to die at (the caller may
        half-do its work first, then `kill`)."""
        if point != self.point:
            return False
        with self._lock:
            self._count += 1
            return self._count == self.at

    def kill(self, point: str) -> None:
        print(f"radixserve: crash point {point}:{self.at} reached, kill -9", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def reached(self, point: str) -> None:
        if self.armed(point):
            self.kill(point)
