"""The order the disk tier drops kept copies in (engine/disk_places.py: `DiskPlaces.spare`):
a copy another disk page continues is the prefix that page needs to be restored after a
crash, so it goes only after that page (a kept run goes tail first), unless another
written file holds the same page. Dropping head first left the tail's files on disk but
unrestorable: the serving crash test got 88-92% of the disk pages back."""

from __future__ import annotations

from radixserve.engine.disk_places import DiskPlaces
from radixserve.storage import DiskPageStore, TierPages
from radixserve.storage.journal import PagePlace

from .store_helpers import PAGE_SIZE, fingerprint, payload_for


def write(disk: TierPages, slot: int, name: bytes, parent: bytes | None) -> None:
    disk.describe(slot, PagePlace(name, parent, None, [slot] * PAGE_SIZE))
    disk.write_page(slot, payload_for(slot))


def test_a_kept_run_goes_tail_first_and_a_continued_copy_stays(tmp_path):
    store = DiskPageStore(tmp_path / "kv", fingerprint(), journal_sync_ms=0)
    disk = TierPages(store)
    places = DiskPlaces(disk, PAGE_SIZE)
    try:
        run = [0, 1, 2, 3]                  # a loaded node's kept pages, oldest first
        for slot, (name, parent) in zip(run, [(b"a", None), (b"b", b"a"), (b"c", b"b"),
                                              (b"d", b"c")]):
            write(disk, slot, name, parent)
        write(disk, 7, b"x", None)          # another kept copy, with no continuation
        assert places.spare([*run, 7], 5) == [3, 2, 1, 0, 7]
        assert places.spare([*run, 7], 2) == [3, 2]

        write(disk, 4, b"e", b"d")          # a disk page continues the run: it needs it all
        assert places.spare([*run, 7], 5) == [7]
        write(disk, 5, b"d", b"c")          # a second written file of page d
        assert places.spare([*run, 7], 5) == [3, 7]   # d has a copy; c, b, a are needed

        disk.drop_page(4)                   # the continuation left the disk
        assert places.spare(run, 4) == [3]  # slot 5 still continues c with page d
        disk.drop_page(5)
        assert places.spare(run, 4) == [3, 2, 1, 0]
    finally:
        store.close()
