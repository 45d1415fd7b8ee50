"""PhaseTimer: wall time of the named, consecutive phases of a start-up.

`radixserve serve` prints them once ready, so a slow start says where its time went;
scripts/bench_startup.py collects them over several starts. The first phase is measured
from the process's own start (Linux /proc), so the interpreter and imports count too.
"""

from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started, from /proc (None where there is no /proc).
    Resolution is one clock tick (10 ms)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class PhaseTimer:
    def __init__(self, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self._last = self.start
        self.phases: list[tuple[str, float]] = []
        self.notes: list[str] = []

    @classmethod
    def since_process_start(cls) -> "PhaseTimer":
        age = process_age_s()
        return cls(time.perf_counter() - (age or 0.0))

    def lap(self, name: str) -> float:
        """Close the phase `name`, which ran since the previous lap (or the start)."""
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        self.phases.append((name, elapsed))
        return elapsed

    def note(self, text: str) -> None:
        """A fact worth printing with the phases (e.g. "weights cache: hit")."""
        self.notes.append(text)

    @property
    def total_s(self) -> float:
        return self._last - self.start

    def summary(self) -> str:
        """One line: 'ready in 3.10 s: imports 1.52 s, ... (notes)'."""
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.phases)
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"ready in {self.total_s:.2f} s: {parts}{notes}"
