"""RestartBudget: how often a dead publisher process may be restarted (process_publisher.py).

A child that dies once (killed, out of memory) is worth restarting; one that dies at every
start would cost the engine a Python start-up and a whole-tree snapshot each time. So at
most `max_restarts` in any `window_s`; past that the engine serves on without events.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RestartBudget:
    """A sliding-window count of restarts: `take` books one if the window has room."""

    def __init__(self, max_restarts: int = 3, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()

    def take(self) -> bool:
        """Book a restart now; False (nothing booked) when the window is full."""
        now, times = self._clock(), self._times
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True

    def describe(self) -> str:
        return f"{self.max_restarts} times in {self.window_s:.0f} s"
