"""TierPages: the disk tier (L3) as slots over the one DiskPageStore of --kv-disk-dir.

The cache's bookkeeping (cache/tiers.py) addresses disk pages by slot, `[0, capacity)`,
reused as pages come and go; the store names page files by keys that are never reused (an
index on disk must never name a later write). This maps each slot to the key of the file
holding it now, so the disk tier's pages and the saved cache's pages are the same files:
the saver indexes an L3 node by its slots' keys, and a restore hands the index's keys to
fresh slots (`adopt`) without reading them (the load path checks their CRC).

Each disk-tier page is `describe`d (where it sits in the tree: storage/journal.py's
PagePlace) before its write; its `PageAdded` record goes to the store's journal just
before the file is written (write-ahead: a crash never leaves a complete file unjournaled),
so a crash before the next save keeps it. The path hash stays known per
slot (`hash_of`) for the saver, which takes over the copies an inclusive load keeps.

A hybrid model's page may come with its sliding-window KV (`window`): written as a file
of its own just before the page's, under the same rules (checked header, serial), and
named by the page's `PageAdded` record, so a crash keeps the window with its page; it is
dropped with the page (`window_key_of` names it for the saver's index).

While a save is writing its index (`holding_drops`), dropped pages stay on disk, so the
index never names a file removed between the walk that chose it and its write; they are
removed afterwards.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator

from .disk_store import DiskPageStore, DiskStoreFull
from .journal import PageAdded, PagePlace, PagesTouched

__all__ = ["TierPages"]

log = logging.getLogger(__name__)


class TierPages:
    def __init__(self, store: DiskPageStore):
        self.store = store
        self.faults = store.faults
        self._key: dict[int, int] = {}          # slot -> page key of its file
        self._window: dict[int, int] = {}       # slot -> key of its window's file (hybrid)
        self._lock = threading.Lock()
        self._held: list[int] | None = None     # keys dropped while a save holds drops
        self._places: dict[int, PagePlace] = {} # slot -> where its page sits in the tree
        self._by_hash: dict[bytes, set[int]] = {}   # path hash -> slots described with it
        self._by_parent: dict[bytes, set[int]] = {}  # parent hash -> slots continuing it

    def write_page(self, slot: int, payload: bytes, window: bytes | None = None) -> None:
        """Store the slot's page under a new key, and its sliding-window KV (`window`, a
        hybrid model's) first under one more (DiskStoreFull etc.: the slot reads as
        missing; a window that does not fit is left out, its match point backs off).
        Runs on the writer thread (the disk tier) or a save's."""
        with self._lock:
            place = self._places.get(slot)
        self.drop_page(slot)                    # a stale mapping (its write raced a drop)
        window_key, window_serial = self._write_window(window)
        key = self.store.new_page_key()

        def journal(serial: int) -> None:       # written ahead of the file: see write_page
            self.store.journal_append(PageAdded(key, serial, place.path_hash,
                                                place.parent_hash, place.namespace,
                                                place.token_ids, place.last_access,
                                                window_key, window_serial))

        try:
            self.store.write_page(key, payload, journal if place is not None else None)
        except BaseException:
            if window_key:
                self.store.drop_page(window_key)
            raise
        with self._lock:
            self._key[slot] = key
            if window_key:
                self._window[slot] = window_key
        self.describe(slot, place)              # drop_page above forgot it

    def _write_window(self, window: bytes | None) -> tuple[int, int]:
        """(key, serial) of the window's new file; (0, 0) without one or when it fails."""
        if window is None:
            return 0, 0
        key = self.store.new_page_key()
        try:
            return key, self.store.write_page(key, window)
        except (DiskStoreFull, OSError) as e:
            log.debug("KV disk store %s: a window not written (%s)", self.store.directory, e)
            return 0, 0

    def window_key_of(self, slot: int) -> int:
        """The key of the slot's window file (0: none)."""
        return self._window.get(slot, 0)

    def has_window(self, slot: int) -> bool:
        """Whether the slot's page has a window file (cache/window_files.py)."""
        key = self._window.get(slot)
        return key is not None and self.store.has_page(key)

    def read_window(self, slot: int) -> bytes | None:
        """The slot's window, checked (None: none, or it failed its check: then dropped)."""
        key = self._window.get(slot)
        return None if key is None else self.store.read_page(key)

    def touched(self, slots: list[int], last_access: int) -> None:
        """These slots' pages moved into the pool at the tree's clock `last_access`
        (their files stay): journaled, so a restart ranks them by it."""
        keys = [k for k in map(self._key.get, slots) if k is not None]
        if keys:
            self.store.journal_append(PagesTouched(keys, last_access))

    def describe(self, slot: int, place: PagePlace | None) -> None:
        """Where the page about to be written into `slot` sits in the tree (tree thread,
        before its write is queued); None: not known, the page is not journaled."""
        with self._lock:
            self._forget_place(slot)
            if place is not None:
                self._places[slot] = place
                self._by_hash.setdefault(place.path_hash, set()).add(slot)
                if place.parent_hash is not None:
                    self._by_parent.setdefault(place.parent_hash, set()).add(slot)

    def _forget_place(self, slot: int) -> None:
        old = self._places.pop(slot, None)
        if old is not None:
            _discard(self._by_hash, old.path_hash, slot)
            if old.parent_hash is not None:
                _discard(self._by_parent, old.parent_hash, slot)

    def needed(self, slot: int, gone: set[int]) -> bool:
        """Whether dropping `slot` would leave another disk page (written or queued, not
        in `gone`) without its prefix on disk, so unrestorable after a crash: some page
        continues its path and no other written file holds the same page."""
        with self._lock:
            place = self._places.get(slot)
            if place is None:
                return False
            if all(s in gone for s in self._by_parent.get(place.path_hash, ())):
                return False
            return not any(s != slot and s not in gone and s in self._key
                           for s in self._by_hash.get(place.path_hash, ()))

    def parent_slots(self, slot: int) -> list[int]:
        """The slots holding (or about to hold) the page before this slot's page."""
        with self._lock:
            place = self._places.get(slot)
            if place is None or place.parent_hash is None:
                return []
            return list(self._by_hash.get(place.parent_hash, ()))

    def has_hash(self, path_hash: bytes) -> bool:
        """Whether some slot holds (or is about to hold) the page of this path."""
        return bool(self._by_hash.get(path_hash))

    def copies_of(self, slot: int) -> list[int]:
        """The other slots holding a written file of the same page (same path hash)."""
        with self._lock:
            place = self._places.get(slot)
            if place is None:
                return []
            return [s for s in self._by_hash.get(place.path_hash, ())
                    if s != slot and s in self._key]

    def hash_of(self, slot: int) -> bytes | None:
        """The path hash of the page in `slot` (None: not known)."""
        place = self._places.get(slot)
        return place.path_hash if place is not None else None

    def read_page(self, slot: int) -> bytes | None:
        key = self._key.get(slot)
        return None if key is None else self.store.read_page(key)

    def drop_page(self, slot: int) -> None:
        """Remove the slot's page file and its window's."""
        with self._lock:
            keys = [k for k in (self._key.pop(slot, None), self._window.pop(slot, None))
                    if k is not None]
            self._forget_place(slot)
            if keys and self._held is not None:
                self._held.extend(keys)
                return
        for key in keys:
            self.store.drop_page(key)

    def adopt(self, slot: int, key: int, place: PagePlace | None = None,
              window_key: int = 0) -> None:
        """A restored page: `slot` is held by the file `key` (not read here), and its
        window by `window_key` (0: none)."""
        self.describe(slot, place)
        with self._lock:
            self._key[slot] = key
            if window_key:
                self._window[slot] = window_key

    def key_of(self, slot: int) -> int | None:
        return self._key.get(slot)

    @contextmanager
    def holding_drops(self) -> Iterator[None]:
        with self._lock:
            self._held = []
        try:
            yield
        finally:
            with self._lock:
                held, self._held = self._held, None
            for key in held:
                self.store.drop_page(key)

    def close(self) -> None:
        """Nothing of its own: the store is closed by its owner (the persistence)."""


def _discard(by: dict[bytes, set[int]], key: bytes, slot: int) -> None:
    same = by.get(key)
    if same is not None:
        same.discard(slot)
        if not same:
            del by[key]
