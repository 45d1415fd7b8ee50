"""PeerShare: this engine's side of the cluster store (`--kv-share`, radixserve/share).

What moves, and when:
- **Publish (write-through).** Once a prompt's prefill has computed every page a later
  request could load (all whole pages before its last token), those pages' keys (the path
  hash of each page, scoped to the model: share/keys.py) not yet known to be in the store
  become a `PublishOrder`. The runner copies the pages to bytes at the start of the next
  step (compute thread, before anything can reuse them), and a publisher thread hands them
  to the store: the step never waits for the store.
- **Load on a miss.** At admission, after the pool and the host/disk tiers matched what
  they could, the rest of the prompt's keys go to the lookup thread (engine/peer_lookup.py)
  and the request waits in the queue, so a slow store never holds up other requests'
  steps. That thread asks how far the prompt's pages continue in the store and, while the
  measured cost per token of a peer load is below recompute's (engine/tier_costs.py),
  fetches them (each CRC- and key-checked: a bad one ends the run and is counted). The
  next admission takes the answer: new pool pages join the tree on the lease
  (`PrefixLease.take_loaded`), and a `PeerLoadOrder` writes their bytes in before the
  step's forward pass.
- **Claims: a prefix computed once, even in a burst.** The lookup also claims the pages
  this replica will compute (SharedStore.claim: a claim file, or an entry in the Ray
  directory, with a deadline). A replica whose first missing page is claimed by a live
  peer waits for that peer's publication instead of computing it (polling its lookup
  every `POLL_S`), then loads it. **The wait ends when the claim does**: published (load
  it), released (the claimer aborted: compute at once) or expired (the claimer died or
  stalled: take the claim over, compute). A claim lasts 4x its holder's measured time to
  compute the pages, and the holder renews it while its prefill progresses (`progress`),
  so a live claimer's claim ends by publishing however busy the machine. The waiter's own
  compute time does not end a wait: the holder computes the pages anyway, so a waiter that
  stops waiting adds a computation of them to the cluster's work (bench_cluster's
  shared-prefix run computed 4,216 prompt tokens with the store against 3,700 without,
  when three waits ran out that bound under load and recomputed); it saves only latency,
  and only if the holder is slower than this replica would be. Claims are released once
  the pages are published, or when the sequence ends without publishing them (an abort,
  an error).

Orders run in this order at the start of a step: publishes (they read pages a finished
request left unlocked, before an eviction can reuse them), the tiers' moves, peer loads
(into pages allocated after those moves were issued), then copy-on-write.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.path_hash import prompt_path_hashes
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.tiers import ReadPending
from radixserve.cache.token_keys import TokenIds, prefix
from radixserve.engine.peer_lookup import Lookup, LookupThread, ShareTicket
from radixserve.engine.tier_costs import TierCosts
from radixserve.share.keys import ShareScope, entry_key
from radixserve.share.store import SharedStore
from radixserve.storage.queue_worker import QueueWorker

if TYPE_CHECKING:
    from radixserve.engine.request import SeqState

__all__ = ["PeerLoadOrder", "PeerOrders", "PeerShare", "PublishOrder", "ShareStats"]

log = logging.getLogger(__name__)

KNOWN_KEYS = 65536      # keys remembered as in the store (published or fetched here)
POLL_S = 0.02           # a request waiting on a peer's claim asks the store this often
CLAIM_TTL_S = 30.0      # a claim's length before this replica has measured its prefill
MIN_CLAIM_S = 2.0       # ... and its bounds once it has (4x the measured compute time)
UNMEASURED_LOOKUP_S = 1.0   # a lookup's deadline before this replica has measured a prefill
CLOSE_WAIT_S = 5.0      # shutdown waits this long at most for the store's threads


@dataclass(frozen=True, slots=True)
class PublishOrder:
    """Copy pool `pages` to bytes and publish them under `keys` (one each); then drop
    this replica's claims on `release`."""

    keys: tuple[bytes, ...]
    pages: np.ndarray
    release: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerLoadOrder:
    """Write fetched page bytes into pool `pages`."""

    pages: np.ndarray
    payloads: tuple[bytes, ...]


@dataclass
class PeerOrders:
    publish: list[PublishOrder] = field(default_factory=list)
    loads: list[PeerLoadOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.publish or self.loads)


@dataclass
class ShareStats:
    """For /cache/stats ("share") and /metrics (radixserve_kv_share_*)."""

    store: str
    loaded_tokens: int = 0          # prompt tokens loaded from the store (peers' pages)
    loads: int = 0                  # admissions that loaded some
    load_seconds: float = 0.0       # fetch time of those loads
    bytes_fetched: int = 0
    bytes_published: int = 0
    published_pages: int = 0
    duplicate_pages: int = 0        # publishes another replica had made already
    forgotten_pages: int = 0        # entries gone when looked for (evicted, dead owner)
    refused_pages: int = 0          # CRC or key mismatch: recomputed, never served
    skipped_slow: int = 0           # misses not loaded: the store was slower than compute
    pending_publishes: int = 0
    claimed_pages: int = 0          # pages claimed before computing them (peers wait)
    waits: int = 0                  # admissions that waited for a peer's claimed pages
    wait_seconds: float = 0.0       # their time waiting
    waits_expired: int = 0          # waits ended by the claim's expiry: computed
    lookups_late: int = 0           # misses the store did not answer within recompute's time

    @property
    def load_s_per_token(self) -> float | None:
        return self.load_seconds / self.loaded_tokens if self.loaded_tokens else None

    def as_dict(self) -> dict:
        return {**asdict(self), "load_s_per_token": self.load_s_per_token}

    def merged(self, other: "ShareStats") -> "ShareStats":
        """The sum of two replicas' figures (the cluster's total)."""
        out = replace(self)
        for f in fields(self):
            value = getattr(other, f.name)
            if isinstance(value, (int, float)):
                setattr(out, f.name, getattr(out, f.name) + value)
        return out


@dataclass(frozen=True, slots=True)
class StoreOrder:
    """One item for the publisher thread: publish `keys` (their `payloads`), then drop
    this replica's claims on `release`; or renew its claims on `renew` for `ttl_s`."""

    keys: tuple[bytes, ...] = ()
    payloads: tuple[bytes, ...] | list[bytes] = ()
    release: tuple[bytes, ...] = ()
    renew: tuple[bytes, ...] = ()
    ttl_s: float = 0.0


class Publisher(QueueWorker[StoreOrder]):
    """The thread that hands copied pages to the store, off the step, and then releases
    the claims they answer (peers waiting on them find the pages published first); it
    also renews the claims of prefills in progress (in order with their releases)."""

    def __init__(self, store: SharedStore, owner: str):
        self.store = store
        self.owner = owner
        self.queued = 0
        super().__init__("kv-share-publisher")

    def submit(self, keys: tuple[bytes, ...], payloads: list[bytes],
               release: tuple[bytes, ...] = ()) -> None:
        self._submit(StoreOrder(keys, payloads, release))

    def renew(self, keys: tuple[bytes, ...], ttl_s: float) -> None:
        self._submit(StoreOrder(renew=keys, ttl_s=ttl_s))

    def _submit(self, order: StoreOrder) -> None:
        with self._lock:
            self.queued += 1
        self._put(order)

    def _handle(self, order: StoreOrder) -> None:
        try:
            if order.keys:
                self.store.publish_many(order.keys, order.payloads)
            if order.renew:
                self.store.claim(order.renew, self.owner, order.ttl_s)
        finally:
            try:
                if order.release:
                    self.store.release_claims(order.release, self.owner)
            finally:
                with self._lock:
                    self.queued -= 1


class PeerShare:
    def __init__(self, store: SharedStore, scope: ShareScope, page_size: int,
                 costs: TierCosts | None = None, owner: str = "local",
                 lookup_min_s: float = 1.0):
        self.store = store
        self.scope = scope
        self.page_size = page_size
        self.owner = owner              # this replica, in claims (and the Ray directory)
        self.lookup_min_s = lookup_min_s    # a lookup's deadline is at least this
        self.close_wait_s = CLOSE_WAIT_S    # shutdown's bound on the store's threads
        self.costs = costs if costs is not None else TierCosts()
        self.publisher = Publisher(store, owner)
        self.lookups = LookupThread(self._answer, self._release)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._orders = PeerOrders()
        self._stats = ShareStats(store=store.name)

    # ------------------------------------------------------------------ keys
    def keys(self, tokens: TokenIds, num_pages: int, namespace: str | None) -> list[bytes]:
        hashes = prompt_path_hashes(prefix(tokens, num_pages * self.page_size),
                                    self.page_size, namespace)
        return [entry_key(self.scope, h) for h in hashes]

    def _remember(self, keys) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ load on a miss
    def pending(self, seq: SeqState) -> bool:
        """The sequence waits on the store (its lookup in flight, or a peer's claim):
        admission skips it without taking a lease. A lookup queued behind a stuck one is
        not waited for (admission takes it as late: `load`)."""
        ticket = seq.share
        return ticket is not None and ticket.pending() \
            and not self._behind_stuck(ticket.lookup)

    def _behind_stuck(self, look: Lookup | None) -> bool:
        """`look` is unanswered and queued behind a lookup the store has not answered
        within its compute time: the one lookup thread would reach it only once the store
        comes back, so it is late now, whatever its own deadline (a waiting poll's is the
        wait's end, up to CLAIM_TTL_S)."""
        return look is not None and not look.done and self.lookups.stuck() \
            and self.lookups.current is not look

    def load(self, lease: PrefixLease, seq: SeqState) -> int:
        """Extend a fresh lease's match with the store's pages of this prompt, when loading
        beats computing. Returns the tokens loaded (0: none; the lease is unchanged).
        Raises ReadPending (the lease unchanged) while the store is being asked, or while
        a live peer computes the prompt's next pages (their claim)."""
        ps = self.page_size
        have, want = lease.num_tree_pages, (len(seq.token_ids) - 1) // ps
        if want <= have or len(lease.pages) != have:
            return 0
        ticket = seq.share = seq.share or ShareTicket()
        if ticket.missed:
            return 0
        look = ticket.lookup
        if look is not None and not look.done:
            if not look.overdue and not self._behind_stuck(look):
                raise ReadPending
            return self._late(ticket)
        if look is None or look.have != have:       # first ask, or the pool matched more
            if self.lookups.stuck():                # queueing behind it would be later still
                return self._late(ticket)
            keys = self.keys(seq.token_ids, want, seq.request.namespace)[have:]
            self._ask(ticket, tuple(keys), have)
        if look.waits_on_peer and not ticket.gave_up:
            left = self._wait_left(ticket, look)
            if left > 0:
                if time.monotonic() < ticket.retry_at:
                    raise ReadPending
                self._ask(ticket, look.keys, have, left)    # asks again: published yet?
            ticket.gave_up = True                       # waited long enough: compute
            self._stats.waits_expired += 1
            self._ask(ticket, look.keys, have)
        return self._take_answer(lease, seq, ticket, look)

    def _ask(self, ticket: ShareTicket, keys: tuple[bytes, ...], have: int,
             wait_left_s: float = 0.0) -> None:
        """Send a lookup for `keys` to the lookup thread; the request waits (ReadPending).
        Claims an earlier answer made stay the sequence's (released when it ends).

        Two deadlines, on purpose, because they answer two questions. `deadline`: when
        *this* sequence stops waiting for the answer and computes (`overdue`): the time
        computing the pages would take, or for a poll of a sequence waiting on a peer's
        claim (`wait_left_s`: what is left of that wait) the wait's end, since one slow
        poll among the hundreds of a long wait (a busy machine, a busy directory actor)
        must not turn the peer's prefix into a recompute. `stuck_at`: when the *store*
        counts as stuck for everyone else: always the compute time, so a slow poll makes
        other misses skip the store (they compute at once, `LookupThread.stuck`) and the
        lookups queued behind it stop waiting (`_behind_stuck`) long before that poll's
        own deadline. One deadline would either let a slow poll turn the wait into a
        recompute, or let a stuck store hold every other miss for a whole wait."""
        if ticket.lookup is not None:
            self._settle(ticket, ticket.lookup)
        now, budget = time.monotonic(), self._lookup_budget(len(keys))
        ticket.lookup = look = Lookup(keys, have, not ticket.gave_up,
                                      self._claim_ttl(len(keys)),
                                      now + max(budget, wait_left_s), now + budget)
        ticket.retry_at = time.monotonic() + POLL_S
        self.lookups.ask(look)
        raise ReadPending

    def _late(self, ticket: ShareTicket) -> int:
        """The store did not answer within recompute's time: a miss (0 tokens loaded), and
        this sequence asks no more. A late answer is dropped when it comes, its claims
        released (by the lookup thread, or here if it came in between); an earlier,
        answered lookup's claims stay the sequence's (released when it ends)."""
        self._stats.lookups_late += 1
        ticket.missed = True
        look, ticket.lookup = ticket.lookup, None
        if look is None:
            return 0
        if look.done:
            self._settle(ticket, look)
            return 0
        look.abandoned = True
        if look.done:                   # answered just now: its claims are not kept
            self._release(look.claimed_keys)
        return 0

    def _lookup_budget(self, num_pages: int) -> float:
        """A lookup's deadline from now: the measured time to compute its pages."""
        per_token = self.costs.prefill_s_per_token
        if per_token is None:
            return max(self.lookup_min_s, UNMEASURED_LOOKUP_S)
        return max(self.lookup_min_s, per_token * num_pages * self.page_size)

    def _claim_ttl(self, num_pages: int) -> float:
        """How long a claim lasts: 4x this replica's measured time to compute the pages."""
        per_token = self.costs.prefill_s_per_token
        if per_token is None:
            return CLAIM_TTL_S
        return min(CLAIM_TTL_S, max(MIN_CLAIM_S, 4 * per_token * num_pages * self.page_size))

    def _wait_left(self, ticket: ShareTicket, look: Lookup) -> float:
        """Seconds left of the wait (<= 0: compute): until the peer's claim expires (its
        holder renews it while it computes; see the module's docstring)."""
        now = time.time()
        if ticket.wait_started is None:
            ticket.wait_started = now
            self._stats.waits += 1
        return look.claim.held_until - now

    def _answer(self, look: Lookup) -> None:
        """On the lookup thread: how far the store has the prompt; claim the pages after
        that (or find them claimed by a live peer: then wait, fetch nothing); fetch the
        published ones while loading beats computing."""
        keys = look.keys
        look.published = n = self.store.published(keys)
        if n < len(keys):
            look.claim = self.store.claim(keys[n:], self.owner, look.claim_ttl_s)
            if look.waits_on_peer:
                return
        if not n:
            return
        if not self.costs.peer_worth_loading():
            look.slow = True
            return
        started = time.perf_counter()
        look.fetched = got = self.store.fetch(keys[:n])
        look.seconds = time.perf_counter() - started
        if got.payloads:
            self.costs.observe_peer_load(len(got.payloads) * self.page_size, look.seconds)

    def _take_answer(self, lease: PrefixLease, seq: SeqState, ticket: ShareTicket,
                     look: Lookup) -> int:
        """Apply an answered lookup: its claims are the sequence's, its pages loaded."""
        s = self._stats
        if not look.counted:
            self._settle(ticket, look)
            if ticket.wait_started is not None:
                s.wait_seconds += time.time() - ticket.wait_started
                ticket.wait_started = None
        payloads = look.fetched.payloads
        n = len(payloads)
        pages = lease.take_loaded(seq.token_ids, n) if n else None
        if pages is None:
            return 0
        self._orders.loads.append(PeerLoadOrder(pages, tuple(payloads)))
        self._remember(look.keys[:n])
        s.loaded_tokens += n * self.page_size
        s.loads += 1
        s.load_seconds += look.seconds
        return n * self.page_size

    def _settle(self, ticket: ShareTicket, look: Lookup) -> None:
        """Once per answered lookup: its claims become the sequence's, its figures count."""
        if look.counted or not look.done:
            return
        look.counted = True
        ticket.add_claims(look.claimed_keys)
        if look.claim.claimed:
            ticket.renew_at = time.monotonic() + look.claim_ttl_s / 2
        self._stats.claimed_pages += look.claim.claimed
        self._stats.skipped_slow += look.slow

    def retire(self, seq: SeqState) -> None:
        """The sequence ended (finished, aborted, failed): claims it still holds go (their
        pages will not be published by it), so waiting peers compute at once. A lookup
        still in flight releases its own claims when it is answered."""
        ticket, seq.share = seq.share, None
        if ticket is None:
            return
        claimed = ticket.claimed
        look = ticket.lookup
        if look is not None and not look.counted:
            look.abandoned = True
            if look.done:
                claimed += look.claimed_keys
        self._release(claimed)

    def _release(self, keys: tuple[bytes, ...]) -> None:
        """Drop this replica's claims on `keys`, on the publisher's thread (after any
        publish queued before: a claim goes once its pages are in the store); once the
        publisher has stopped (a lookup answered after shutdown), on the caller's."""
        if not keys:
            return
        if self.publisher.alive:
            self.publisher.submit((), [], keys)
        else:
            self.store.release_claims(keys, self.owner)

    # ------------------------------------------------------------------ publish
    def progress(self, seq: SeqState) -> None:
        """The sequence computed more of its prompt: claims it holds past half their life
        are renewed (a fresh `_claim_ttl`, on the publisher thread), so a claim outlives
        its holder's prefill however long a busy machine makes it, and expires only once
        the holder stops progressing (dead, or stalled)."""
        ticket = seq.share
        if ticket is None or not ticket.claimed or time.monotonic() < ticket.renew_at:
            return
        ttl = self._claim_ttl(len(ticket.claimed))
        ticket.renew_at = time.monotonic() + ttl / 2
        self.publisher.renew(ticket.claimed, ttl)

    def publish(self, seq: SeqState) -> None:
        """After a prompt's prefill: its loadable pages that the store may lack, queued
        for copying at the next step; its claims released once they are published, and
        renewed now, so that a slow publish (many files on a busy disk) cannot outlast
        them: a claim that ends by publishing is always waited for and loaded."""
        lease, ticket = seq.lease, seq.share
        release = ticket.claimed if ticket is not None else ()
        if ticket is not None:
            ticket.claimed = ()
        n = min((seq.prompt_len - 1) // self.page_size, lease.num_tree_pages)
        keys = self.keys(seq.token_ids, n, seq.request.namespace) if n > 0 else []
        new = [i for i, key in enumerate(keys) if key not in self._known]
        if not new:
            self._release(release)
            return
        self._remember(keys[i] for i in new)
        if release:
            self.publisher.renew(release, self._claim_ttl(len(release)))
        self._orders.publish.append(PublishOrder(tuple(keys[i] for i in new),
                                                 lease.pages[new].copy(), release))

    # ------------------------------------------------------------------ the step
    def take_orders(self) -> PeerOrders | None:
        if not self._orders:
            return None
        orders, self._orders = self._orders, PeerOrders()
        return orders

    def has_orders(self) -> bool:
        return bool(self._orders)

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every page handed to the publisher is in the store (tests, saves);
        False if `timeout` seconds passed first (a stuck store)."""
        return self.publisher.drain(timeout)

    def stats(self) -> ShareStats:
        s, c = self._stats, self.store.counters
        s.bytes_fetched, s.bytes_published = c.bytes_fetched, c.bytes_published
        s.published_pages, s.duplicate_pages = c.published_pages, c.duplicate_pages
        s.forgotten_pages, s.refused_pages = c.forgotten_pages, c.refused_pages
        s.pending_publishes = self.publisher.queued
        return s

    def close(self, wait_s: float | None = None) -> None:
        """Stop the lookup and publisher threads, waiting `wait_s` seconds at most for each:
        a store call that never returns (a hung NFS mount, an unreachable directory actor)
        must not hold the engine's shutdown. A thread still in such a call is a daemon and
        is left behind, logged; a lookup it answers late releases its claims itself (on
        that thread, as the publisher is gone); claims nothing could release expire by
        their deadline (CLAIM_TTL_S at most). `wait_s` defaults to `close_wait_s`."""
        wait_s = self.close_wait_s if wait_s is None else wait_s
        if not self.lookups.close(wait_s):
            current = self.lookups.current
            if current is not None:
                current.abandoned = True        # its claims go when it is answered
            log.warning("--kv-share: the %s store did not answer a lookup within %.1f s of "
                        "shutdown; its thread is left behind", self.store.name, wait_s)
        if not self.publisher.close(wait_s):
            log.warning("--kv-share: the %s store did not take %d queued publish(es) within "
                        "%.1f s of shutdown; they are dropped", self.store.name,
                        self.publisher.queued, wait_s)
        self.store.close()
