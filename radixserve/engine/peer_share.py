"""PeerShare: this engine's side of the cluster store (`--kv-share`, radixserve/share).

What moves, and when:
- **Publish (write-through).** Once a prompt's prefill has computed every page a later
  request could load (all whole pages before its last token), those pages' keys (the path
  hash of each page, scoped to the model: share/keys.py) not yet known to be in the store
  become a `PublishOrder`. The runner copies the pages to bytes at the start of the next
  step (compute thread, before anything can reuse them), and a publisher thread hands them
  to the store: the step never waits for the store.
- **Load on a miss.** At admission, after the pool and the host/disk tiers matched what
  they could, the store is asked how far the prompt's pages continue there; while the
  measured cost per token of a peer load is below recompute's (engine/tier_costs.py), the
  pages are fetched (each CRC- and key-checked: a bad one ends the run and is counted),
  new pool pages join the tree on the lease (`PrefixLease.take_loaded`), and a
  `PeerLoadOrder` writes their bytes in before the step's forward pass. The fetch runs on
  the event loop's thread at admission: a local directory read, or a Ray get bounded by a
  timeout.

Orders run in this order at the start of a step: publishes (they read pages a finished
request left unlocked, before an eviction can reuse them), the tiers' moves, peer loads
(into pages allocated after those moves were issued), then copy-on-write.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from radixserve.cache.path_hash import prompt_path_hashes
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.token_keys import TokenIds, prefix
from radixserve.engine.tier_costs import TierCosts
from radixserve.share.keys import ShareScope, entry_key
from radixserve.share.store import SharedStore
from radixserve.storage.queue_worker import QueueWorker

__all__ = ["PeerLoadOrder", "PeerOrders", "PeerShare", "PublishOrder", "ShareStats"]

KNOWN_KEYS = 65536      # keys remembered as in the store (published or fetched here)


@dataclass(frozen=True, slots=True)
class PublishOrder:
    """Copy pool `pages` to bytes and publish them under `keys` (one each)."""

    keys: tuple[bytes, ...]
    pages: np.ndarray


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


class Publisher(QueueWorker[tuple[tuple[bytes, ...], list[bytes]]]):
    """The thread that hands copied pages to the store, off the step."""

    def __init__(self, store: SharedStore):
        self.store = store
        self.queued = 0
        super().__init__("kv-share-publisher")

    def submit(self, keys: tuple[bytes, ...], payloads: list[bytes]) -> None:
        with self._lock:
            self.queued += 1
        self._put((keys, payloads))

    def _handle(self, item) -> None:
        keys, payloads = item
        try:
            self.store.publish_many(keys, payloads)
        finally:
            with self._lock:
                self.queued -= 1


class PeerShare:
    def __init__(self, store: SharedStore, scope: ShareScope, page_size: int,
                 costs: TierCosts | None = None):
        self.store = store
        self.scope = scope
        self.page_size = page_size
        self.costs = costs if costs is not None else TierCosts()
        self.publisher = Publisher(store)
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
    def load(self, lease: PrefixLease, tokens: TokenIds, namespace: str | None,
             max_tokens: int) -> int:
        """Extend a fresh lease's match with the store's pages of this prompt, when loading
        beats computing. Returns the tokens loaded (0: none; the lease is unchanged)."""
        ps = self.page_size
        have, want = lease.num_tree_pages, max_tokens // ps
        if want <= have or len(lease.pages) != have:
            return 0
        keys = self.keys(tokens, want, namespace)[have:]
        started = time.perf_counter()
        if not self.store.published(keys):
            return 0
        if not self.costs.peer_worth_loading():
            self._stats.skipped_slow += 1
            return 0
        got = self.store.fetch(keys)
        seconds = time.perf_counter() - started
        n = len(got.payloads)
        if n:
            self.costs.observe_peer_load(n * ps, seconds)
        pages = lease.take_loaded(tokens, n) if n else None
        if pages is None:
            return 0
        self._orders.loads.append(PeerLoadOrder(pages, tuple(got.payloads)))
        self._remember(keys[:n])
        s = self._stats
        s.loaded_tokens += n * ps
        s.loads += 1
        s.load_seconds += seconds
        return n * ps

    # ------------------------------------------------------------------ publish
    def publish(self, lease: PrefixLease, tokens: TokenIds, prompt_len: int,
                namespace: str | None) -> None:
        """After a prompt's prefill: its loadable pages that the store may lack, queued
        for copying at the next step."""
        n = min((prompt_len - 1) // self.page_size, lease.num_tree_pages)
        if n <= 0:
            return
        keys = self.keys(tokens, n, namespace)
        new = [i for i, key in enumerate(keys) if key not in self._known]
        if not new:
            return
        self._remember(keys[i] for i in new)
        self._orders.publish.append(PublishOrder(tuple(keys[i] for i in new),
                                                 lease.pages[new].copy()))

    # ------------------------------------------------------------------ the step
    def take_orders(self) -> PeerOrders | None:
        if not self._orders:
            return None
        orders, self._orders = self._orders, PeerOrders()
        return orders

    def has_orders(self) -> bool:
        return bool(self._orders)

    def drain(self) -> None:
        """Block until every page handed to the publisher is in the store (tests, saves)."""
        self.publisher.drain()

    def stats(self) -> ShareStats:
        s, c = self._stats, self.store.counters
        s.bytes_fetched, s.bytes_published = c.bytes_fetched, c.bytes_published
        s.published_pages, s.duplicate_pages = c.published_pages, c.duplicate_pages
        s.forgotten_pages, s.refused_pages = c.forgotten_pages, c.refused_pages
        s.pending_publishes = self.publisher.queued
        return s

    def close(self) -> None:
        self.publisher.close()
        self.store.close()
