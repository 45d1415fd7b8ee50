"""Pinned prefixes: prompts the engine keeps in the KV pool until they are unpinned.

A pin is a `PrefixLease` that holds the lock on the prefix's path in the radix tree and
no private page. The tree never evicts a locked node, so a pinned prefix stays in the pool
(and, with host/disk tiers, is never demoted) whatever the traffic; admission already
counts only free + evictable pages (`PagedMemory.available_pages`), so pinned pages are
never promised to a request. Unpinning releases the lease: the pages stay cached, now
evictable like any other prefix.

A prefix that is not cached yet is computed by a one-token request through the normal
scheduler. Its pages enter the tree when it finishes; `settle()` takes the lock right
then, on the engine loop before the next step is scheduled, so nothing can evict them in
between. Pins cover whole pages only (the tree holds nothing else): a prompt's trailing
partial page is not pinned.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from radixserve.cache.memory import PagedMemory
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.window_lease import new_lease
from radixserve.cache.token_keys import pack
from radixserve.engine.errors import PinConflict, PinLimitExceeded, UnknownPin
from radixserve.engine.request import Request


@dataclass(frozen=True)
class PinInfo:
    """What a caller learns about a pin (no token contents)."""

    pin_id: str
    tokens: int                 # pinned tokens (the prompt's whole pages)
    namespace: str | None
    cached_tokens: int          # of those, already cached when the pin was asked for
    created: bool = True        # False: the same prefix was pinned already (same id)


@dataclass(eq=False)
class _Pin:
    info: PinInfo
    key: tuple[str | None, bytes]
    lease: PrefixLease


@dataclass(eq=False)
class _PendingPin:
    """A pin waiting for its one-token request to put the prefix in the tree."""

    request: Request
    tokens: list[int]
    namespace: str | None
    cached_tokens: int
    done: asyncio.Future
    waiters: int = 1            # callers awaiting `done` (the same prefix asked again)
    cancelled: bool = False


@dataclass(eq=False)
class PinBook:
    """The engine's pins, their token budget (`limit`) and the pins still computing."""

    memory: PagedMemory
    limit: int
    _pins: dict[str, _Pin] = field(default_factory=dict)
    _by_key: dict[tuple[str | None, bytes], _Pin] = field(default_factory=dict)
    _pending: list[_PendingPin] = field(default_factory=list)

    # ---- reading --------------------------------------------------------------------
    @property
    def pinned_tokens(self) -> int:
        """Tokens of all pinned prefixes, summed (overlapping pins count their shared
        part once per pin): what `limit` bounds."""
        return sum(p.info.tokens for p in self._pins.values())

    @property
    def count(self) -> int:
        return len(self._pins)

    def infos(self) -> list[PinInfo]:
        return [p.info for p in self._pins.values()]

    def get(self, pin_id: str) -> PinInfo:
        pin = self._pins.get(pin_id)
        if pin is None:
            raise UnknownPin(f"no pinned prefix has the id {pin_id[:100]!r}")
        return pin.info

    def find(self, tokens: list[int], namespace: str | None) -> PinInfo | None:
        """The pin of exactly this prefix in this namespace, if any."""
        pin = self._by_key.get((namespace, pack(tokens)))
        return None if pin is None else pin.info

    def locked_tokens(self) -> int:
        """Tree tokens the pins' locks cover (each node once): with no request running,
        the tree's locked_tokens must equal this."""
        seen: set[int] = set()
        total = 0
        for pin in self._pins.values():
            node = pin.lease.node
            while node is not None and node.depth and node.id not in seen:
                seen.add(node.id)
                total += node.num_tokens
                node = node.parent
        return total

    # ---- pinning --------------------------------------------------------------------
    def check_room(self, requested: int) -> None:
        """PinLimitExceeded unless `requested` more tokens fit in the budget (pins being
        computed count as pinned, so concurrent pins cannot pass it together)."""
        committed = self.pinned_tokens + sum(len(p.tokens) for p in self._pending)
        if committed + requested > self.limit:
            raise PinLimitExceeded(requested, committed, self.limit)

    def hold(self, tokens: list[int], namespace: str | None, cached_tokens: int) -> PinInfo:
        """Lock the cached prefix `tokens` (whole pages) and record the pin; the same
        prefix pinned twice keeps one pin (its id, created=False)."""
        existing = self.find(tokens, namespace)
        if existing is not None:
            return PinInfo(existing.pin_id, existing.tokens, existing.namespace,
                           existing.cached_tokens, created=False)
        lease = new_lease(self.memory, namespace)
        lease.acquire(tokens)
        if lease.tree_tokens < len(tokens):
            got = lease.tree_tokens
            lease.release()
            raise PinConflict(f"the prefix could not be kept: {got} of its {len(tokens)} "
                              f"tokens are in the cache after computing it", code="pin_failed")
        info = PinInfo(f"pin-{secrets.token_hex(8)}", len(tokens), namespace, cached_tokens)
        pin = _Pin(info, (namespace, pack(tokens)), lease)
        self._pins[info.pin_id] = pin
        self._by_key[pin.key] = pin
        return info

    def expect(self, request: Request, tokens: list[int], namespace: str | None,
               cached_tokens: int) -> _PendingPin:
        """Register a pin whose prefix `request` is computing; `settle` completes it."""
        pending = _PendingPin(request, tokens, namespace, cached_tokens,
                              asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        return pending

    def pending_for(self, tokens: list[int], namespace: str | None) -> _PendingPin | None:
        """The pin of exactly this prefix still being computed, if any; joining it adds
        a waiter (so the same prefix asked twice at once is computed and counted once)."""
        for pending in self._pending:
            if pending.namespace == namespace and pending.tokens == tokens:
                pending.waiters += 1
                return pending
        return None

    def settle(self) -> None:
        """Lock the prefixes of pin requests that have finished (their pages just entered
        the tree). The engine calls it before scheduling each step."""
        if not self._pending or not any(p.request.finished for p in self._pending):
            return
        still = []
        for pending in self._pending:
            if not pending.request.finished:
                still.append(pending)
                continue
            if pending.cancelled or pending.done.done():
                continue
            try:
                pending.done.set_result(self.hold(pending.tokens, pending.namespace,
                                                  pending.cached_tokens))
            except PinConflict as exc:
                pending.done.set_exception(exc)
        self._pending = still

    def cancel(self, pending: _PendingPin) -> bool:
        """A caller stopped waiting. When it was the last one, no lock will be taken for
        the pin, and True says the computing request may be aborted."""
        pending.waiters -= 1
        if pending.waiters > 0 or pending.done.done():
            return False
        pending.cancelled = True
        if pending in self._pending:
            self._pending.remove(pending)
        return True

    def fail_pending(self, error: BaseException) -> None:
        """The engine stops: every pin still computing fails with `error`."""
        for pending in self._pending:
            if not pending.done.done():
                pending.done.set_exception(error)
        self._pending = []

    def unpin(self, pin_id: str) -> PinInfo:
        """Drop the pin's lock: its pages stay cached, evictable again."""
        info = self.get(pin_id)
        pin = self._pins.pop(pin_id)
        del self._by_key[pin.key]
        pin.lease.release()
        return info

    def drop_all(self) -> None:
        """Release every pin (engine shutdown)."""
        for pin_id in list(self._pins):
            self.unpin(pin_id)
