"""Releases lapsed TimedPins without traffic: a background task of the aiohttp app.

TimedPins expires lazily, on each take/refresh/sweep, so a server with no traffic would
keep a lapsed pin's pages locked until the next request. The sweeper sleeps until the
soonest deadline (at most `max_wait_s`, so a pin taken meanwhile is seen), sweeps, and
repeats; it is cancelled when the app shuts down. The wait is injected so tests move a
clock and wake it instead of sleeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from radixserve.server.timed_pins import TimedPins

log = logging.getLogger(__name__)

MAX_WAIT_S = 5.0        # a pin taken while the sweeper sleeps lapses at most this late


class PinSweeper:
    def __init__(self, pins: Sequence[TimedPins], max_wait_s: float = MAX_WAIT_S,
                 wait: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.pins = list(pins)
        self.max_wait_s = max_wait_s
        self.wait = wait
        self.released = 0

    def next_wait_s(self) -> float:
        """Seconds until the soonest live deadline, capped at `max_wait_s`."""
        soonest = min((p.next_expiry() for p in self.pins if p.next_expiry() is not None),
                      default=None)
        if soonest is None:
            return self.max_wait_s
        now = min(p.clock() for p in self.pins)
        return min(self.max_wait_s, max(0.0, soonest - now))

    async def sweep_once(self) -> int:
        released = 0
        for pins in self.pins:
            released += await pins.sweep()
        self.released += released
        return released

    async def run(self) -> None:
        """Sweep forever (until cancelled); a failed sweep is logged, not fatal."""
        while True:
            await self.wait(self.next_wait_s())
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception:       # noqa: BLE001 - the next round retries; serving goes on
                log.exception("sweeping lapsed pins failed")


PIN_SWEEPER_TASK = web.AppKey("pin_sweeper_task", asyncio.Task)


def background(sweeper: PinSweeper):
    """An aiohttp cleanup context running `sweeper` from startup to shutdown."""
    async def context(app: web.Application):
        task = asyncio.create_task(sweeper.run(), name="pin-sweeper")
        app[PIN_SWEEPER_TASK] = task
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    return context
