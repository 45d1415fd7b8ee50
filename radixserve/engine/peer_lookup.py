"""Asking the cluster store at admission, off the event loop (`--kv-share`).

The store may be slow (a file read on NFS, a Ray get bounded by a 5 s timeout), and the
event-loop thread that admits requests also drives every other request's steps. So an
admission that misses part of its prompt in the pool only *asks* (`Lookup`) and the
request waits in the queue (`ReadPending`, as for a disk-tier read); the lookup thread asks
the store how far the prompt is published, claims the pages this replica will compute, and
fetches the published ones; a later admission takes the answer (engine/peer_share.py).

A lookup has a deadline: as long as computing its pages would take (measured). One still
unanswered then (a stuck or slow store) is a miss: the request computes, and the answer,
when it comes, is dropped (its claims released). While the thread is stuck past a deadline,
new misses do not queue behind it, and those already queued behind it stop waiting: they
compute at once (engine/peer_share.py). So one stuck store call delays other requests by
at most one lookup's compute time, however many lookups there are.

A `ShareTicket` is one sequence's dealings with the store across its admissions: its
current lookup, its wait for a peer's claim, and the keys it claimed (released once its
pages are published, or when it ends without publishing them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from radixserve.share.store import Claim, Fetched
from radixserve.storage.queue_worker import QueueWorker

__all__ = ["Lookup", "LookupThread", "ShareTicket"]


@dataclass
class Lookup:
    """One question to the store about a prompt's pages after the pool's match."""

    keys: tuple[bytes, ...]         # the prompt's page keys from page `have` on
    have: int                       # pages the pool matched when this was asked
    may_wait: bool                  # a live peer claim on the first missing page: wait
    claim_ttl_s: float              # how long this replica's claims last
    deadline: float = math.inf      # time.monotonic() after which the asker computes instead
    stuck_at: float = math.inf      # ... after which, unanswered, the store counts as stuck
                                    #   (a waiting poll's deadline is later: peer_share.py)
    # The answer, written by the lookup thread before `done`.
    published: int = 0              # leading keys the store listed
    fetched: Fetched = field(default_factory=Fetched)
    seconds: float = 0.0            # the fetch's time
    slow: bool = False              # published, but not fetched: slower than computing
    claim: Claim = Claim()          # on keys[published:]
    done: bool = False
    counted: bool = False           # its figures are in ShareStats (once per answer)
    abandoned: bool = False         # its sequence ended before the answer was taken

    @property
    def claimed_keys(self) -> tuple[bytes, ...]:
        return self.keys[self.published:self.published + self.claim.claimed]

    @property
    def waits_on_peer(self) -> bool:
        return self.may_wait and self.claim.held_until is not None

    @property
    def overdue(self) -> bool:
        """Unanswered past its deadline: slower than computing, so a miss."""
        return not self.done and time.monotonic() > self.deadline


@dataclass
class ShareTicket:
    """A sequence's store state (SeqState.share)."""

    lookup: Lookup | None = None
    retry_at: float = 0.0               # time.monotonic() a waiting lookup is asked again
    wait_started: float | None = None   # time.time() its wait for a peer's claim began
    gave_up: bool = False               # the wait's bound passed: compute, wait no more
    missed: bool = False                # a lookup passed its deadline: compute, ask no more
    claimed: tuple[bytes, ...] = ()     # keys it claimed and has not released
    renew_at: float = math.inf          # time.monotonic() its claims are next renewed

    def pending(self) -> bool:
        """Its lookup is in flight (within its deadline), or it waits on a peer and is not
        due to ask again."""
        look = self.lookup
        if look is None:
            return False
        if not look.done:
            return not look.overdue
        return look.waits_on_peer and not self.gave_up and time.monotonic() < self.retry_at

    def add_claims(self, keys: tuple[bytes, ...]) -> None:
        self.claimed += tuple(k for k in keys if k not in self.claimed)


class LookupThread(QueueWorker[Lookup]):
    """The thread that answers lookups in order (`answer` does the store calls; `release`
    drops the claims of a lookup whose sequence ended, or stopped waiting for it, while it
    was being answered). A lookup abandoned before its turn is not asked at all."""

    def __init__(self, answer: Callable[[Lookup], None],
                 release: Callable[[tuple[bytes, ...]], None]):
        self.answer = answer
        self.release = release
        self.current: Lookup | None = None      # the lookup being answered now
        super().__init__("kv-share-lookup")

    def ask(self, lookup: Lookup) -> None:
        self._put(lookup)

    def stuck(self) -> bool:
        """The lookup being answered is past its deadline (the store is stuck or slow)."""
        current = self.current
        return current is not None and not current.done and time.monotonic() > current.stuck_at

    def _handle(self, lookup: Lookup) -> None:
        if lookup.abandoned:
            lookup.done = True
            return
        self.current = lookup
        try:
            self.answer(lookup)
        except Exception:       # a store failure is a miss: the prompt is computed
            lookup.fetched, lookup.claim = Fetched(), Claim()
        finally:
            lookup.done = True
            self.current = None
            if lookup.abandoned and lookup.claimed_keys:
                self.release(lookup.claimed_keys)
