"""DiskJournal: the disk tier's changes since the last index write, appended and checksummed.

The index (store_index.py) is written only at a save or a compaction; without this file a
crash between two index writes would lose every page the disk tier wrote since. Each change
is appended as it happens, so a restart replays index + journal (journal_replay.py).

    <dir>/journal/<seq:016x>.log    magic, then records: length u32, CRC32C u32, msgpack

Records are by page, named by the page's path hash (cache/path_hash.py), so the tree's edge
splits never matter and a record's parent is found whichever file holds it:
- `PageAdded`: a page file is complete (written, fsynced, renamed): its key and write
  serial, its path hash, the previous page's (None: the first page of its namespace), its
  namespace and tokens, and the key and serial of its window file when a hybrid model's
  sliding-window KV was written beside it;
- `PagesDropped`: these page files are gone (the disk tier evicted or dropped them);
- `PagesTouched`: these pages moved from disk into the pool (loaded, or recomputed over)
  at the tree's clock `last_access`; their files stay (the tier is inclusive), and a
  restart ranks them by that recency, not by the one they were written with.

Every append goes to the file at once (a `kill -9` loses nothing the kernel has), and the
file is fsynced in batches every `sync_ms` by a thread (0: at each append), after the pages
directory, so a record never outlives its page's rename on a power loss. A record a crash
cut short (a torn tail) fails its length or CRC: reading stops at the last good record, and
`cut_torn_tail` truncates the file there. A new file is started (`rotate`) when an index is
written; the index records the first file it does not cover (`StoreIndex.journal_from`).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import crc32c
import msgspec

from .atomic_files import fsync_dir, fsync_file
from .crash_points import CrashPoints
from .disk_faults import DiskFaults

__all__ = ["PageAdded", "PagesDropped", "PagesTouched", "PagePlace", "Record", "DiskJournal", "JournalRead",
           "read_journal", "journal_files", "JOURNAL_DIR"]

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"
JOURNAL_MAGIC = b"RXKVJNL1"
_FRAME = struct.Struct("<II")           # payload length, crc32c
_SUFFIX = ".log"
MAX_RECORD = 1 << 24                    # a larger length is damage, not a record


class PageAdded(msgspec.Struct, tag="add", array_like=True):
    key: int
    serial: int
    path_hash: bytes
    parent_hash: bytes | None       # None: the first page of its namespace
    namespace: str | None
    token_ids: list[int]            # the page's tokens (one page)
    last_access: int = 0
    # A hybrid model's sliding-window KV of the page, written as a file of its own just
    # before the page's (tier_pages.py): its key and serial (0: none; trailing fields, so
    # older journals decode).
    window_key: int = 0
    window_serial: int = 0


class PagesDropped(msgspec.Struct, tag="drop", array_like=True):
    keys: list[int]


class PagesTouched(msgspec.Struct, tag="touch", array_like=True):
    keys: list[int]
    last_access: int


Record = PageAdded | PagesDropped | PagesTouched


class PagePlace(msgspec.Struct, frozen=True):
    """Where a disk page sits in the tree: what its `PageAdded` record says besides the
    file (engine/disk_places.py computes it)."""

    path_hash: bytes
    parent_hash: bytes | None
    namespace: str | None
    token_ids: list[int]
    last_access: int = 0
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def encode_record(record: Record) -> bytes:
    payload = _encoder.encode(record)
    return _FRAME.pack(len(payload), crc32c.crc32c(payload)) + payload


@dataclass
class JournalRead:
    records: list[Record]
    good_bytes: int                 # where the last good record ends
    torn: bool                      # bytes after it that are not a whole, valid record


def read_journal(path: Path) -> JournalRead:
    """The records of one journal file, up to the first damaged one."""
    data = path.read_bytes()
    if not data.startswith(JOURNAL_MAGIC):
        return JournalRead([], 0, bool(data))
    pos = len(JOURNAL_MAGIC)
    records: list[Record] = []
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        payload = data[pos + _FRAME.size:end]
        if length > MAX_RECORD or end > len(data) or crc32c.crc32c(payload) != crc:
            break
        try:
            records.append(_decoder.decode(payload))
        except msgspec.DecodeError:
            break
        pos = end
    return JournalRead(records, pos, pos < len(data))


def journal_files(directory: Path) -> list[tuple[int, Path]]:
    """(seq, path) of the journal files in `directory`, oldest first."""
    out = []
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.endswith(_SUFFIX):
                try:
                    out.append((int(path.name[:-len(_SUFFIX)], 16), path))
                except ValueError:
                    continue
    return sorted(out)


def cut_torn_tail(path: Path, read: JournalRead) -> None:
    """Truncate a file after its last good record (one warning names it)."""
    log.warning("KV disk journal %s: a torn tail of %d bytes after the last good record "
                "(a crash mid-append) is cut", path, path.stat().st_size - read.good_bytes)
    with open(path, "r+b") as f:
        f.truncate(max(read.good_bytes, len(JOURNAL_MAGIC)))
        if read.good_bytes < len(JOURNAL_MAGIC):
            f.seek(0)
            f.write(JOURNAL_MAGIC)
        os.fsync(f.fileno())


class DiskJournal:
    """Appends to `<store>/journal/`; thread-safe (the writer thread appends page writes,
    the engine's thread drops). `on_grown` is called (on the sync thread) once the files
    hold more than `max_bytes`: the store compacts them into the index."""

    def __init__(self, directory: Path, pages_dir: Path, faults: DiskFaults, sync_ms: int,
                 crash: CrashPoints, max_bytes: int = 16 << 20,
                 on_grown: Callable[[], None] | None = None):
        self.directory = directory
        self.pages_dir = pages_dir
        self.faults = faults
        self.sync_ms = sync_ms
        self.crash = crash
        self.max_bytes = max_bytes
        self.on_grown = on_grown
        self.records = 0                # appended by this process
        self.syncs = 0
        self._bytes = 0                 # in the files since the last index
        self._lock = threading.Lock()
        self._file = None
        self._seq = 0
        self._dirty = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def bytes(self) -> int:
        return self._bytes

    def start(self, seq: int) -> None:
        """Begin appending to a new file `seq` (after the ones a restart replayed)."""
        self.directory.mkdir(exist_ok=True)
        with self._lock:
            self._open(seq)
        self._thread = threading.Thread(target=self._sync_loop, daemon=True,
                                        name="radixserve-disk-journal")
        self._thread.start()

    def append(self, record: Record) -> None:
        """Write one record (fsynced within `sync_ms`); a failing disk loses it (counted
        in the faults): its page is then missing after a crash, never wrong."""
        data = encode_record(record)
        with self._lock:
            if self._file is None and not self._reopen():
                return
            try:
                if self.crash.armed("journal_append"):
                    self._file.write(data[:len(data) // 2])     # a torn tail, then death
                    self._file.flush()
                    self.crash.kill("journal_append")
                self._file.write(data)
                self._file.flush()
                if self.sync_ms <= 0:
                    self._fsync()
                else:
                    self._dirty = True
            except OSError as e:
                self.faults.write_failed(e, self._path(self._seq))
                self._close_file()              # the next append starts a fresh file
                return
            self.records += 1
            self._bytes += len(data)
            grown = self._bytes > self.max_bytes
        if grown and self.on_grown is not None:
            self._wake.set()

    def rotate(self) -> int:
        """Start a new file; -> its seq. Records after this call are in it (or later)."""
        with self._lock:
            self._sync_now()
            self._close_file()
            self._open(self._seq + 1)
            return self._seq

    def compacted(self, before: int) -> None:
        """An index now covers every file before `before`: remove them."""
        for seq, path in journal_files(self.directory):
            if seq < before:
                path.unlink(missing_ok=True)
        with self._lock:
            self._bytes = self._file.tell() if self._file is not None else 0
        fsync_dir(self.directory)

    def sync(self) -> None:
        with self._lock:
            self._sync_now()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._sync_now()
            self._close_file()

    # -- internals (the lock is held) -------------------------------------------------

    def _path(self, seq: int) -> Path:
        return self.directory / f"{seq:016x}{_SUFFIX}"

    def _open(self, seq: int) -> None:
        self._seq = seq
        try:
            self._file = open(self._path(seq), "ab")
            if self._file.tell() == 0:
                self._file.write(JOURNAL_MAGIC)
                self._file.flush()
            fsync_dir(self.directory)
        except OSError as e:
            self.faults.write_failed(e, self._path(seq))
            self._close_file()

    def _reopen(self) -> bool:
        if not self.faults.may_write():
            return False
        self._open(self._seq + 1)
        return self._file is not None

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _fsync(self) -> None:
        fsync_dir(self.pages_dir)       # the pages' renames first, then the records
        fsync_file(self._file.fileno(), self._path(self._seq))
        self._dirty = False
        self.syncs += 1

    def _sync_now(self) -> None:
        if self._dirty and self._file is not None:
            try:
                self._fsync()
            except OSError as e:
                self.faults.write_failed(e, self._path(self._seq))
                self._close_file()

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.sync_ms / 1000 if self.sync_ms > 0 else None)
            self._wake.clear()
            with self._lock:
                self._sync_now()
                grown = self._bytes > self.max_bytes
            if grown and self.on_grown is not None and not self._stop.is_set():
                try:
                    self.on_grown()
                except Exception:       # a compaction that failed is retried when it grows
                    log.exception("KV disk journal %s: compaction failed", self.directory)
