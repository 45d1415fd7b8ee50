"""The disk tier's journal: replay onto the index, a torn tail cut with one warning,
compaction, and `kill -9` at seeded random moments (mid page write, mid journal append,
mid compaction, after any line): every page whose record was appended comes back, every
page that comes back reads with its own content."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve.storage import DiskPageStore
from radixserve.storage.journal import (PageAdded, PagesDropped, PagesTouched,
                                        journal_files, read_journal)
from radixserve.storage.journal_replay import replay
from radixserve.storage.store_index import INDEX_VERSION, StoreIndex

from .store_helpers import contents_of, fingerprint, node, payload_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]


def added(key: int, h: bytes, parent: bytes | None, content: int) -> PageAdded:
    return PageAdded(key, 100 + key, h, parent, None, tokens_for([content]))


def test_replay_hangs_pages_from_the_index_and_drops_by_file():
    base = node(1, None, [1, 2])
    base.page_hashes = [b"h1", b"h2"]
    index = StoreIndex(INDEX_VERSION, fingerprint(), [base], {1: 11, 2: 12})
    records = [added(3, b"h3", b"h2", 3), added(4, b"h4", b"h3", 4),   # a chain below
               added(5, b"h5", b"h2", 5),                             # a branch at h2
               added(6, b"h6", b"nowhere", 6),                        # parent unknown
               PagesDropped([5]), added(7, b"h4", b"h3", 4)]          # h4 rewritten as 7
    out = replay(index, records, 4)
    shape = [(n.node_id, n.parent_id, n.page_keys) for n in out.nodes]
    assert shape == [(1, None, [1, 2, 3, 7])]          # one run: no branch left at h2
    assert out.nodes[0].token_ids == tokens_for([1, 2, 3, 4])
    assert out.page_serials == {1: 11, 2: 12, 3: 103, 7: 107}
    out = replay(index, records[:3], 4)                 # with the branch
    assert [(n.parent_id, n.page_keys) for n in out.nodes] == \
        [(None, [1, 2]), (1, [3, 4]), (1, [5])]


def test_replay_keeps_each_pages_saved_window_until_the_page_is_rewritten():
    """A hybrid model's saved windows (IndexNode.window_keys) ride with their pages
    through the journal's replay, serials included; a page written again by the disk
    tier has no saved window (its old window file is named no more)."""
    base = node(1, None, [1, 2, 3])
    base.page_hashes, base.window_keys = [b"h1", b"h2", b"h3"], [0, 8, 9]
    index = StoreIndex(INDEX_VERSION, fingerprint(), [base], {1: 11, 2: 12, 3: 13, 8: 18,
                                                              9: 19})
    out = replay(index, [added(4, b"h4", b"h3", 4)], 4)
    assert [(n.page_keys, n.window_keys) for n in out.nodes] == [([1, 2, 3, 4], [0, 8, 9, 0])]
    assert out.page_serials == {1: 11, 2: 12, 3: 13, 8: 18, 9: 19, 4: 104}
    assert out.page_keys() == {1, 2, 3, 4, 8, 9}
    out = replay(index, [added(5, b"h2", b"h1", 2), added(6, b"h3", b"h2", 3)], 4)
    assert [(n.page_keys, n.window_keys) for n in out.nodes] == [([1, 5, 6], [])]
    assert out.page_keys() == {1, 5, 6}


def test_a_journaled_window_rides_with_its_page_until_its_file_or_page_goes():
    """The disk tier writes a page's window beside it and names it in the page's record
    (PageAdded.window_key, serial included): replayed into IndexNode.window_keys; a
    window file that never completed, or dropped alone (it failed its check), is named
    no more while its page stays; dropping the page forgets both."""
    def with_window(key, h, parent, content, window):
        return PageAdded(key, 100 + key, h, parent, None, tokens_for([content]), 0,
                         window, 100 + window)

    index = StoreIndex(INDEX_VERSION, fingerprint(), [])
    records = [with_window(1, b"h1", None, 1, 7), with_window(2, b"h2", b"h1", 2, 8),
               added(3, b"h3", b"h2", 3)]
    out = replay(index, records, 4)
    assert [(n.page_keys, n.window_keys) for n in out.nodes] == [([1, 2, 3], [7, 8, 0])]
    assert out.page_serials == {1: 101, 2: 102, 3: 103, 7: 107, 8: 108}
    out = replay(index, records, 4, present={1, 2, 3, 7})          # 8 never completed
    assert [n.window_keys for n in out.nodes] == [[7, 0, 0]]
    assert 8 not in out.page_serials
    out = replay(index, [*records, PagesDropped([7])], 4)           # the window alone
    assert [(n.page_keys, n.window_keys) for n in out.nodes] == [([1, 2, 3], [0, 8, 0])]
    out = replay(index, [*records, PagesDropped([2])], 4)           # the page: both go
    assert [(n.page_keys, n.window_keys) for n in out.nodes] == [([1], [7])]
    assert out.page_keys() == {1, 7}


def test_a_record_whose_file_never_completed_leaves_the_older_file_in_place():
    """Records are written ahead of their files: a crash mid-write leaves a record naming
    a file that is not on disk. Recovery skips it, so the older file for the same path
    (an earlier write of that page) is restored instead of being replaced by nothing."""
    base = node(1, None, [1, 2])
    base.page_hashes = [b"h1", b"h2"]
    index = StoreIndex(INDEX_VERSION, fingerprint(), [base], {1: 11, 2: 12})
    records = [added(3, b"h3", b"h2", 3),               # written: its file is there
               added(4, b"h3", b"h2", 3),               # h3 written again, killed mid-write
               added(5, b"h5", b"h3", 5)]               # never written at all
    out = replay(index, records, 4, present={1, 2, 3})
    assert [n.page_keys for n in out.nodes] == [[1, 2, 3]]
    assert [n.page_keys for n in replay(index, records, 4).nodes] == [[1, 2, 4, 5]]


def test_a_page_moved_into_the_pool_keeps_its_recency_across_a_restart():
    """A `PagesTouched` record (a load) raises the page's recency, so the restored node
    is ranked by its last use, not by when it was written; a touch of a page no longer on
    disk is ignored."""
    base = node(1, None, [1, 2])
    base.page_hashes = [b"h1", b"h2"]
    index = StoreIndex(INDEX_VERSION, fingerprint(), [base], {1: 11, 2: 12})
    records = [added(3, b"h3", b"h1", 3),               # a branch at h1: two nodes below
               PagesTouched([2], 50), PagesTouched([3, 9], 70), PagesTouched([2], 40)]
    out = replay(index, records, 4)
    assert [(n.page_keys, n.last_access) for n in out.nodes] == \
        [([1], 0), ([2], 50), ([3], 70)]


def test_a_torn_tail_is_cut_with_one_warning_and_the_rest_replayed(tmp_path, caplog):
    store = DiskPageStore(tmp_path / "kv", fingerprint(), journal_sync_ms=0)
    parent = None
    for content in (1, 2, 3):
        key = store.new_page_key()
        serial = store.write_page(key, payload_for(content))
        store.journal_append(PageAdded(key, serial, b"h%d" % content, parent, None,
                                       tokens_for([content])))
        parent = b"h%d" % content
    store.close()
    (_, path), = journal_files(tmp_path / "kv" / "journal")
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])                        # the last record cut short
    with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
        again = DiskPageStore(tmp_path / "kv", fingerprint(), journal_sync_ms=0)
    torn = [r for r in caplog.records if "torn tail" in r.getMessage()]
    assert len(torn) == 1 and again.recovery.torn_tails == 1
    assert again.recovery.journal_records == 2 and again.recovery.pages == 2
    index = again.read_index()
    assert contents_of(index.nodes[0].token_ids) == [1, 2]
    assert all(again.read_page(k) == payload_for(c) for k, c in
               zip(index.nodes[0].page_keys, (1, 2)))
    assert len(again.page_keys()) == 2                  # the third page's file is removed
    again.close()


def test_compaction_folds_the_journal_into_the_index(tmp_path):
    store = DiskPageStore(tmp_path / "kv", fingerprint(), journal_sync_ms=0)
    key = store.new_page_key()
    serial = store.write_page(key, payload_for(1))
    store.journal_append(PageAdded(key, serial, b"h1", None, None, tokens_for([1])))
    store.compact()
    assert store.compactions == 1 and store.read_index().nodes[0].page_keys == [key]
    seqs = [seq for seq, _ in journal_files(tmp_path / "kv" / "journal")]
    assert seqs == [store.read_index().journal_from]   # older files removed
    assert read_journal(journal_files(tmp_path / "kv" / "journal")[0][1]).records == []
    store.close()


def test_a_journal_past_its_bound_is_compacted_by_its_thread(tmp_path):
    store = DiskPageStore(tmp_path / "kv", fingerprint(), journal_sync_ms=0,
                          journal_max_bytes=1)
    key = store.new_page_key()
    serial = store.write_page(key, payload_for(1))
    store.journal_append(PageAdded(key, serial, b"h1", None, None, tokens_for([1])))
    deadline = time.monotonic() + 120
    while not store.compactions:                        # the event: the thread's compaction
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert store.read_index().nodes[0].page_keys == [key]
    store.close()


def run_and_kill(directory: Path, seed: int, crash_at: str | None, after_lines: int
                 ) -> list[str]:
    """Run the journal writer until its crash point kills it, or SIGKILL it after
    `after_lines` lines; -> the lines it printed."""
    env = {k: v for k, v in os.environ.items() if k != "RADIXSERVE_CRASH_AT"}
    if crash_at:
        env["RADIXSERVE_CRASH_AT"] = crash_at
    proc = subprocess.Popen([sys.executable, "-m", "tests.storage.journal_writer",
                             str(directory), str(seed)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        while len(lines) < after_lines:
            line = proc.stdout.readline()
            if not line:
                break                                   # killed by its crash point
            lines.append(line.strip())
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, err
    return lines


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_9_anywhere_loses_no_page_whose_record_was_appended(tmp_path, seed, caplog):
    rng = random.Random(seed)
    directory = tmp_path / "kv"
    live: set[int] = set()
    points = ["page_write", "journal_append", "compaction", None]
    for attempt in range(4):
        point = points[(attempt + seed) % len(points)]
        crash_at = f"{point}:{rng.randint(1, 12 if point != 'compaction' else 2)}" \
            if point else None
        after = rng.randint(3, 80) if crash_at is None else 10**6   # else: its crash point
        lines = run_and_kill(directory, seed * 100 + attempt, crash_at, after)
        for line in lines:
            what, _, key = line.partition(" ")
            if what == "page":
                live.add(int(key))
            elif what == "drop":
                live.discard(int(key))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="radixserve.storage"):
            store = DiskPageStore(directory, fingerprint(), journal_sync_ms=0)
        assert store.usable
        index = store.read_index()
        nodes = index.nodes if index else []
        restored = {k for n in nodes for k in n.page_keys}
        assert live <= restored, (crash_at, sorted(live - restored))
        for n in nodes:                                 # each page holds its own content
            for key, content in zip(n.page_keys, contents_of(n.token_ids)):
                page = store.read_page(key)
                assert page == payload_for(content, len(page))
        assert store.corrupt_pages == 0 and store.stale_pages == 0
        torn = [r for r in caplog.records if "torn tail" in r.getMessage()]
        assert len(torn) == (1 if point == "journal_append" else 0), caplog.text
        live = restored                 # what the next run starts from (a drop in flight
        store.close()                   # when killed may come back: never a wrong page)
