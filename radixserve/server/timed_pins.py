"""Pins with a time to live and a token budget, on top of the engine's pins (engine/pins.py).

A stored response (and, later, a prompt-cache breakpoint) keeps its prefix in the KV pool
through an ordinary engine pin. Unlike a `POST /cache/pin`, such a pin is not the client's
to release: it lapses `ttl_s` after it was taken or last hit, and all of them together stay
within `budget_tokens`. Over budget, the pins that lapse soonest are released first: a
reference that loses its pin is recomputed from its stored tokens when it is used, never
refused. Time comes from an injectable clock, so tests move it instead of sleeping.

Expiry is checked whenever a pin is taken, refreshed or swept; without traffic, the
server's PinSweeper (pin_sweeper.py) sweeps at the soonest deadline.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.engine.errors import EngineError, PinConflict, UnknownPin
from radixserve.server.engine_client import EngineClient

log = logging.getLogger(__name__)


@dataclass
class _Timed:
    pin_id: str
    tokens: int
    expires_at: float
    key: tuple[str | None, bytes]


def pin_key(token_ids: Sequence[int], namespace: str | None) -> tuple[str | None, bytes]:
    return namespace, array("q", token_ids).tobytes()


class TimedPins:
    """The engine pins this server takes on its own, each with a deadline."""

    def __init__(self, engine: EngineClient, ttl_s: float, budget_tokens: int,
                 clock: Callable[[], float] = time.time):
        self.engine = engine
        self.ttl_s = ttl_s
        self.budget_tokens = budget_tokens
        self.clock = clock
        self._pins: dict[str, _Timed] = {}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0 and self.budget_tokens > 0

    @property
    def pinned_tokens(self) -> int:
        return sum(p.tokens for p in self._pins.values())

    def __contains__(self, pin_id: str) -> bool:
        return pin_id in self._pins

    def next_expiry(self) -> float | None:
        """The soonest deadline of a live pin (None when none is held)."""
        return min((p.expires_at for p in self._pins.values()), default=None)

    def holds(self, token_ids: Sequence[int], namespace: str | None) -> bool:
        """A live pin of exactly this prefix exists."""
        key = pin_key(token_ids, namespace)
        return any(p.key == key for p in self._pins.values())

    async def room(self) -> int:
        """Tokens that can still be pinned without releasing a live pin."""
        await self.sweep()
        return self.budget_tokens - self.pinned_tokens if self.enabled else 0

    async def sweep(self) -> int:
        """Release every lapsed pin; how many were released."""
        now = self.clock()
        lapsed = [p.pin_id for p in self._pins.values() if p.expires_at <= now]
        for pin_id in lapsed:
            await self.release(pin_id)
        return len(lapsed)

    async def refresh(self, pin_id: str | None) -> bool:
        """A hit on the pinned prefix: its deadline moves to now + ttl. False when the pin
        is gone (lapsed, released for room), so the caller knows it was recomputed."""
        await self.sweep()
        pin = self._pins.get(pin_id) if pin_id else None
        if pin is None:
            return False
        pin.expires_at = self.clock() + self.ttl_s
        return True

    async def take(self, token_ids: Sequence[int], namespace: str | None,
                   ttl_s: float | None = None, make_room: bool = True) -> str | None:
        """Pin `token_ids` for `ttl_s` (default: the configured TTL), releasing the pins
        that lapse soonest while the budget would be passed. None when pinning is off, the
        prefix is larger than the whole budget (or, without `make_room`, than what is left),
        or the engine refused (its own budget, which `POST /cache/pin` shares, or a prefix
        shorter than a page): the reference then simply has no pin."""
        await self.sweep()
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if not self.enabled or ttl <= 0 or len(token_ids) > self.budget_tokens:
            return None
        if not make_room and self.pinned_tokens + len(token_ids) > self.budget_tokens \
                and not self.holds(token_ids, namespace):
            return None
        while self._pins and self.pinned_tokens + len(token_ids) > self.budget_tokens:
            soonest = min(self._pins.values(), key=lambda p: p.expires_at)
            await self.release(soonest.pin_id)
        try:
            info = await self.engine.pin(token_ids, namespace)
        except (PinConflict, EngineError) as exc:
            log.info("no pin for a stored prefix of %d tokens: %s", len(token_ids), exc)
            return None
        expires = self.clock() + ttl
        held = self._pins.get(info.pin_id)      # the same prefix pinned again: one pin
        if held is not None:
            held.expires_at = max(held.expires_at, expires)
        elif not info.created:      # a client's own POST /cache/pin: not ours to release
            return None
        else:
            self._pins[info.pin_id] = _Timed(info.pin_id, info.tokens, expires,
                                             pin_key(token_ids, namespace))
        return info.pin_id

    async def release(self, pin_id: str | None) -> None:
        """Drop a pin now (its pages stay cached, evictable); unknown ids are ignored."""
        if pin_id is None or self._pins.pop(pin_id, None) is None:
            return
        try:
            await self.engine.unpin(pin_id)
        except UnknownPin:          # the engine dropped it already (it stopped)
            pass

    async def release_all(self) -> None:
        for pin_id in list(self._pins):
            await self.release(pin_id)
