"""DiskPageStore: KV pages as checked files in one directory, and the tree's index beside them.

    <dir>/fingerprint.json      which model configuration wrote the pages (written first)
    <dir>/pages/<key>.page      one page: checked header (magic, key, length, CRC32C) + bytes
    <dir>/index.bin             the tree (store_index.py), checked the same way, written last
    <dir>/journal/*.log         the disk tier's changes since that index (journal.py)
    <dir>/lock                  flock'ed while a server uses the directory

Every file is written to a temporary name, fsynced and renamed (atomic_files.py), and the
index only after the pages it names are on disk, so a `kill -9` at any moment leaves either
the previous index or the new one, each naming complete pages. Opening a directory:

- empty (or absent): a fresh store;
- written for another fingerprint, not ours, or locked by another process: refused in one
  logged line (`refusal`); nothing in it is read further, changed or removed, and every
  write raises StoreRefused;
- ours: stray temporary files are removed, the index is read and checked, and page files
  it does not name (pages of a save that did not finish, or of an unreadable index, which
  is logged) are removed.

With a journal (`journal_sync_ms` not None: the server's disk tier), every page file the
tier completes and every one it drops is appended there as it happens, so a `kill -9`
between two saves loses nothing the kernel has (a power loss: at most `journal_sync_ms`).
Opening replays the index and the journal (journal_replay.py; a torn last record is cut,
with one warning) and writes the result as the new index at once (a compaction), so the
journal stays short; it is compacted again when it grows past `journal_max_bytes`, and at
every save. `recovery` says what the opening found and how long it took.

A page that fails its check when read is never returned: its file is removed, it is
counted in `corrupt_pages` and logged once; the caller recomputes its tokens. A key may be
written again once dropped; every write carries a serial in its header and the index
records the serial of each page it names, so an index never serves a later write under an
old name (such a page -- a crash between rewrite and index -- is dropped as `stale_pages`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import msgspec

from .atomic_files import TMP_SUFFIX, fsync_dir, write_atomic
from .crash_points import CrashPoints
from .disk_faults import DiskFaults, WritesPaused
from .checked_blob import HEADER, BadBlob, StalePage, check_header, check_payload, pack_header
from .fingerprint import ModelFingerprint
from .journal import (JOURNAL_DIR, DiskJournal, PagesDropped, Record, cut_torn_tail,
                      journal_files, read_journal)
from .journal_replay import replay
from .store_index import (INDEX_VERSION, IndexNode, StoreIndex, decode_index, encode_index,
                          restorable)

__all__ = ["DiskPageStore", "StoreRefused", "DiskStoreFull", "STORE_FORMAT", "Recovery"]

log = logging.getLogger(__name__)

STORE_FORMAT = 1
PAGE_MAGIC = b"RXKVPAG1"
FINGERPRINT_FILE = "fingerprint.json"
INDEX_FILE = "index.bin"
PAGES_DIR = "pages"
LOCK_FILE = "lock"
PAGE_SUFFIX = ".page"


class StoreRefused(RuntimeError):
    """The directory is not usable by this server (`DiskPageStore.refusal` says why)."""


class DiskStoreFull(RuntimeError):
    def __init__(self, needed: int, used: int, capacity: int):
        super().__init__(f"disk store full: {needed} more bytes needed, {used} of "
                         f"{capacity} used")
        self.needed, self.used, self.capacity = needed, used, capacity


@dataclass
class Recovery:
    """What opening the directory found: the index's and the journal's share."""

    index_pages: int = 0            # named by the index on disk
    journal_records: int = 0        # replayed on top of it
    torn_tails: int = 0             # journal files cut after their last good record
    pages: int = 0                  # named after the replay (restorable, before checks)
    seconds: float = 0.0            # reading, replaying and compacting


class _StoreHeader(msgspec.Struct):
    format: int
    fingerprint: ModelFingerprint


class DiskPageStore:
    """Pages and the index in `directory`, for the model `fingerprint` describes; at most
    `capacity_bytes` of page files (None: unbounded). Thread-safe: the engine's writer
    thread and its loader may call it concurrently."""

    def __init__(self, directory: str | os.PathLike, fingerprint: ModelFingerprint,
                 capacity_bytes: int | None = None, journal_sync_ms: int | None = None,
                 journal_max_bytes: int = 16 << 20):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.corrupt_pages = 0
        self.stale_pages = 0
        self.pages_dir = self.directory / PAGES_DIR
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}        # page key -> file bytes
        self._used = 0
        self._serials: dict[int, int] = {}      # page key -> serial of its write
        self._next_key = 1
        self._next_serial = time.time_ns()      # grows across restarts too
        self._lock_fd: int | None = None
        self.faults = DiskFaults(str(self.directory))   # I/O errors: counted, never raised up
        self.crash = CrashPoints.from_env()
        self.recovery = Recovery()
        self.compactions = 0
        self._index_lock = threading.Lock()     # one index write (save or compaction) at a time
        self._marks = 0                         # saves between index_mark and write_index
        self.journal: DiskJournal | None = None
        if journal_sync_ms is not None:
            self.journal = DiskJournal(self.directory / JOURNAL_DIR, self.pages_dir,
                                       self.faults, journal_sync_ms, self.crash,
                                       journal_max_bytes, on_grown=self.compact)
        self.refusal: str | None = self._open()
        if self.refusal:
            log.warning("KV disk store %s not used: %s; the directory is left untouched",
                        self.directory, self.refusal)

    # -- state --------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.refusal is None

    def used_bytes(self) -> int:
        return self._used

    def page_keys(self) -> list[int]:
        with self._lock:
            return sorted(self._sizes)

    def has_page(self, page_key: int) -> bool:
        return page_key in self._sizes

    def new_page_key(self) -> int:
        """A key no page of this directory ever had (keys are never reused)."""
        with self._lock:
            key = self._next_key
            self._next_key += 1
            return key

    # -- pages --------------------------------------------------------------------------

    def write_page(self, page_key: int, payload: bytes | memoryview,
                   before_write: Callable[[int], None] | None = None) -> int:
        """Store one page (complete on disk when this returns); -> its write serial.
        `before_write(serial)` runs once the key is reserved, before a byte of the file is
        written: the disk tier journals the page there (write-ahead), so a crash can never
        leave a complete page file without its record; a record whose file never
        completed is skipped at recovery (`replay`'s `present`). Raises StoreRefused,
        DiskStoreFull (nothing written), ValueError for a key stored now (drop it first),
        OSError when the disk fails (reported to `faults`, which may pause writes: then
        WritesPaused, without touching the disk)."""
        self._check_usable()
        path = self._page_path(page_key)
        if not self.faults.may_write():
            raise WritesPaused(errno.EAGAIN, "KV disk writes are paused after a fault", str(path))
        size = HEADER.size + len(payload)
        with self._lock:
            if page_key in self._sizes:
                raise ValueError(f"page key {page_key:#x} is stored; drop it first")
            if self.capacity_bytes is not None and self._used + size > self.capacity_bytes:
                raise DiskStoreFull(size, self._used, self.capacity_bytes)
            self._sizes[page_key] = size          # reserved: concurrent writers see it
            self._used += size
            self._next_key = max(self._next_key, page_key + 1)
            serial = self._serials[page_key] = self._next_serial
            self._next_serial += 1
        try:
            if before_write is not None:
                before_write(serial)
            write_atomic(path, [pack_header(PAGE_MAGIC, page_key, payload, serial), payload],
                         before_rename=lambda: self.crash.reached("page_write"))
        except BaseException as e:
            self._forget(page_key)
            if isinstance(e, OSError):
                self.faults.write_failed(e, path)
            raise
        self.faults.write_ok()
        return serial

    def journal_append(self, record: Record) -> None:
        """Append to the journal (nothing without one)."""
        if self.journal is not None and self.usable:
            self.journal.append(record)

    def read_page(self, page_key: int) -> bytes | None:
        """The page's bytes; None when it is not stored, fails its check (then it is
        dropped, counted in `corrupt_pages` and logged) or is stale (`stale_pages`)."""
        if not self.usable or page_key not in self._sizes:
            return None
        try:
            with open(self._page_path(page_key), "rb") as f:
                length, crc = check_header(PAGE_MAGIC, page_key, f.read(HEADER.size),
                                           self._serials.get(page_key))
                payload = f.read(length)
                check_payload(payload, length, crc, trailing=bool(f.read(1)))
            self.crash.reached("load")
            return payload
        except StalePage as e:
            self._reject(page_key, "stale_pages", str(e))
        except (BadBlob, FileNotFoundError) as e:
            self._reject(page_key, "corrupt_pages", f"failed its check ({e})")
        except OSError as e:                    # EIO and the like: the disk, not the page
            self.faults.read_failed(e, self._page_path(page_key))
            self.drop_page(page_key)
        return None

    def _reject(self, page_key: int, counter: str, why: str) -> None:
        """Never serve this page again: count it, log it once, drop it."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
        log.warning("KV disk store %s: page %#x %s; dropped, its tokens will be recomputed",
                    self.directory, page_key, why)
        self.drop_page(page_key)

    def drop_page(self, page_key: int) -> None:
        """Remove a page (nothing when it is not stored). A removal the disk refuses is
        reported to `faults`; the file stays, unnamed by the tree (the next start removes
        it unless the last save's index names it, with the content it had then)."""
        self._check_usable()
        if self._forget(page_key):
            self.journal_append(PagesDropped([page_key]))
            path = self._page_path(page_key)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                self.faults.write_failed(e, path)

    # -- index --------------------------------------------------------------------------

    def new_index(self, nodes: Sequence[IndexNode]) -> StoreIndex:
        return StoreIndex(INDEX_VERSION, self.fingerprint, list(nodes))

    @contextmanager
    def index_mark(self) -> Iterator[int | None]:
        """A save's start: journal records from here on are replayed onto the index it
        writes (`write_index(since=mark)`), and no compaction runs until it is written."""
        with self._index_lock:
            mark = self.journal.rotate() if self.journal is not None else None
            self._marks += 1
        try:
            yield mark
        finally:
            with self._index_lock:
                self._marks -= 1

    def write_index(self, index: StoreIndex, since: int | None = None) -> None:
        """Replace the index, crash-safely. Every page it names must be stored (written
        and fsynced): ValueError otherwise, and the old index stays. `since`: a mark from
        `index_mark`, taken before the tree was walked for `index`: the journal's records
        since then are replayed onto it, and the journal files it covers are removed."""
        self._check_usable()
        if index.fingerprint != self.fingerprint or index.version != INDEX_VERSION:
            raise ValueError("index for another fingerprint or version")
        keys = index.page_keys()
        with self._lock:
            missing = keys.difference(self._sizes)
            serials = {k: self._serials[k] for k in keys if k in self._serials}
        if missing:
            raise ValueError(f"index names {len(missing)} pages not stored, e.g. "
                             f"{min(missing):#x}")
        index = StoreIndex(index.version, index.fingerprint, index.nodes, serials)
        with self._index_lock:
            if self.journal is None or since is None:
                self._write_index_file(index, 0)
                return
            end = self.journal.rotate()
            tail = self._journal_records(since, end)
            self._write_index_file(replay(index, tail, self.fingerprint.page_size), end)

    def compact(self) -> None:
        """Fold the journal into the index (it grew past its bound); skipped while a save
        is between its mark and its index, which will do the same."""
        with self._index_lock:
            if self.journal is None or self._marks or not self.usable:
                return
            end = self.journal.rotate()
            base = self._load_index() or self.new_index([])
            self._write_index_file(replay(base, self._journal_records(base.journal_from, end),
                                          self.fingerprint.page_size), end)
            self.compactions += 1

    def _write_index_file(self, index: StoreIndex, journal_from: int) -> None:
        """Write `index` as covering the journal files before `journal_from`, then remove
        those files (the index lock is held)."""
        index.journal_from = journal_from
        fsync_dir(self.pages_dir)                 # the pages' renames are durable first
        write_atomic(self.directory / INDEX_FILE, encode_index(index), sync_dir=True)
        self.crash.reached("compaction")
        if self.journal is not None:
            self.journal.compacted(journal_from)
        else:
            for _, path in journal_files(self.directory / JOURNAL_DIR):
                path.unlink(missing_ok=True)

    def _journal_records(self, first: int, end: int | None = None,
                         cut: bool = False) -> list[Record]:
        """The records of the journal files `first` <= seq < `end`, in order; `cut`: a
        torn tail is truncated (at start, with one warning) and counted."""
        records: list[Record] = []
        for seq, path in journal_files(self.directory / JOURNAL_DIR):
            if seq < first or (end is not None and seq >= end):
                continue
            read = read_journal(path)
            records.extend(read.records)
            if read.torn and cut:
                self.recovery.torn_tails += 1
                cut_torn_tail(path, read)
        return records

    def read_index(self) -> StoreIndex | None:
        """The index on disk, reduced to the nodes that can be restored (see
        store_index.restorable); None when there is none or it is unreadable (logged)."""
        if not self.usable:
            return None
        return self._restorable(self._load_index())

    def _restorable(self, index: StoreIndex | None) -> StoreIndex | None:
        if index is None:
            return None
        with self._lock:
            stored = set(self._sizes)
        result = restorable(index, self.fingerprint.page_size, stored)
        if result.dropped:
            log.warning("KV disk store %s: %d of %d indexed nodes not restored (first: %s)",
                        self.directory, len(result.dropped), len(index.nodes),
                        result.dropped[0])
        return result.index

    def close(self) -> None:
        """Sync and close the journal, release the directory's lock (the process exiting
        does that too)."""
        if self.journal is not None and self.usable:
            self.journal.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- opening ------------------------------------------------------------------------

    def _open(self) -> str | None:
        """Adopt or create the directory; -> why it is refused, or None."""
        header_path = self.directory / FINGERPRINT_FILE
        if not header_path.exists():
            refusal = self._create()
            if refusal:
                return refusal
        else:
            refusal = self._check_fingerprint(header_path)
            if refusal:
                return refusal
        refusal = self._take_lock()
        if refusal:
            return refusal
        self.pages_dir.mkdir(exist_ok=True)
        self._scan_pages()
        started = time.perf_counter()
        next_seq = self._recover()
        self._remove_unindexed()
        self.recovery.seconds = time.perf_counter() - started
        if self.journal is not None:
            self.journal.start(next_seq)
        return None

    def _recover(self) -> int:
        """Replay the journal onto the index and write the result as the index (nothing
        to do without journal files); -> the seq the next journal file takes."""
        files = journal_files(self.directory / JOURNAL_DIR)
        next_seq = files[-1][0] + 1 if files else 1
        base = self._load_index()
        self.recovery.index_pages = len(base.page_keys()) if base is not None else 0
        if files:
            base = base or self.new_index([])
            records = self._journal_records(base.journal_from, cut=True)
            self.recovery.journal_records = len(records)
            with self._index_lock:
                self._write_index_file(replay(base, records, self.fingerprint.page_size,
                                              present=set(self._sizes)), next_seq)
            if records:
                log.info("KV disk store %s: replayed %d journal records onto an index of "
                         "%d pages", self.directory, len(records), self.recovery.index_pages)
        return next_seq

    def _create(self) -> str | None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            foreign = [p.name for p in self.directory.iterdir()
                       if not p.name.endswith(TMP_SUFFIX)]
        except OSError as e:
            return f"cannot create or list it: {e}"
        if foreign:
            return (f"it is not empty and has no {FINGERPRINT_FILE} (holds e.g. "
                    f"{sorted(foreign)[0]!r}), so it is not a radixserve KV store")
        header = msgspec.json.encode(_StoreHeader(STORE_FORMAT, self.fingerprint))
        write_atomic(self.directory / FINGERPRINT_FILE, [header], sync_dir=True)
        return None

    def _check_fingerprint(self, header_path: Path) -> str | None:
        try:
            header = msgspec.json.decode(header_path.read_bytes(), type=_StoreHeader)
        except (OSError, msgspec.DecodeError) as e:
            return f"its {FINGERPRINT_FILE} is unreadable ({e})"
        if header.format != STORE_FORMAT:
            return f"store format {header.format} there, {STORE_FORMAT} here"
        mismatch = header.fingerprint.describe_mismatch(self.fingerprint)
        if mismatch:
            return f"written for another model configuration: {mismatch}"
        return None

    def _take_lock(self) -> str | None:
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return "another server is using it (its lock is held)"
        self._lock_fd = fd
        return None

    def _scan_pages(self) -> None:
        highest = 0
        for path in self.pages_dir.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)      # a write a crash interrupted
                continue
            key = _page_key_of(path.name)
            if key is not None:
                self._sizes[key] = path.stat().st_size
                highest = max(highest, key)
        (self.directory / (INDEX_FILE + TMP_SUFFIX)).unlink(missing_ok=True)
        self._used = sum(self._sizes.values())
        self._next_key = highest + 1

    def _remove_unindexed(self) -> None:
        """Remove the page files no restorable index node names: they can never be used."""
        raw = self._load_index()
        named = raw.page_keys() if raw is not None else set()
        index = self._restorable(raw)
        keep = index.page_keys() if index is not None else set()
        self.recovery.pages = len(keep)
        unused = [k for k in self._sizes if k not in keep]
        if unused:
            for key in unused:
                self._forget(key)
                self._page_path(key).unlink(missing_ok=True)
            fsync_dir(self.pages_dir)
            log.warning("KV disk store %s: ignored and removed %d page files that no "
                        "restorable index entry names (an interrupted save, or a damaged "
                        "index)", self.directory, len(unused))
        if index is not None:
            self._serials = {k: v for k, v in index.page_serials.items() if k in keep}
            self._next_serial = max([self._next_serial, *(v + 1 for v in self._serials.values())])
        self._next_key = max([self._next_key, *(k + 1 for k in named)])

    def _load_index(self) -> StoreIndex | None:
        path = self.directory / INDEX_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("KV disk store %s: cannot read the index (%s); its pages are "
                        "ignored", self.directory, e)
            return None
        try:
            index = decode_index(data)
        except BadBlob as e:
            log.warning("KV disk store %s: the index is unreadable (%s); its pages are "
                        "ignored", self.directory, e)
            return None
        if index.fingerprint != self.fingerprint:
            log.warning("KV disk store %s: the index was written for another model "
                        "configuration; its pages are ignored", self.directory)
            return None
        return index

    # -- helpers ------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.refusal:
            raise StoreRefused(self.refusal)

    def _page_path(self, page_key: int) -> Path:
        return self.pages_dir / f"{page_key:016x}{PAGE_SUFFIX}"

    def _forget(self, page_key: int) -> bool:
        with self._lock:
            size = self._sizes.pop(page_key, None)
            self._serials.pop(page_key, None)
            if size is not None:
                self._used -= size
            return size is not None


def _page_key_of(name: str) -> int | None:
    if not name.endswith(PAGE_SUFFIX):
        return None
    try:
        return int(name[:-len(PAGE_SUFFIX)], 16)
    except ValueError:
        return None

