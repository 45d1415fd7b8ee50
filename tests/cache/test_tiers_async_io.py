"""The tree's side of the disk writer and reader threads, with fakes that report when the
test says so: pending writes, loads from the writer's queue, orphaned slots, failed writes,
and admissions that wait for their reads. Conservation of every tier after each step."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.tiers import DISK, DemoteOrder, ReadPending

from .test_tiers import cache, tiered


class FakeWriter:
    """Takes pages like the DiskWriter; finishes them only when `finish` is called."""

    def __init__(self, store):
        self.store, self.held, self.done, self.failed = store, {}, [], []

    def submit_orders(self, tiers):
        for mv in tiers.take_moves():
            if isinstance(mv, DemoteOrder) and mv.dst_tier == DISK:
                for key in mv.dst.tolist():
                    self.held[key] = key.to_bytes(8, "little")

    def finish(self, fail=(), first=None):
        """Write the queued pages (the `first` few of them only, when given)."""
        for key, payload in sorted(self.held.items())[:first]:
            if key in self.done:
                continue
            if key in fail:
                self.failed.append(key)
            else:
                self.store.write_page(key, payload)
                self.done.append(key)

    def held_page(self, key):
        return self.held.get(key)

    def take_finished(self):
        done, failed = self.done, self.failed
        self.done, self.failed = [], []
        for key in (*done, *failed):
            self.held.pop(key, None)
        return done, failed


class FakeReader:
    def __init__(self, store):
        self.store, self.asked_keys, self.results, self.finished = store, [], {}, []

    def request(self, keys):
        self.asked_keys.extend(keys)

    def asked(self, key):
        return key in self.asked_keys or key in self.results

    def ready(self, key):
        return key in self.results

    def take(self, key):
        return self.results.pop(key)

    def take_finished(self):
        done, self.finished = self.finished, []
        return done

    def discard(self, key):
        self.results.pop(key, None)

    def finish(self):
        for key in self.asked_keys:
            self.results[key] = self.store.read_page(key)
            self.finished.append(key)
        self.asked_keys = []


def setup():
    tree, mem, tiers, store = tiered(host=0)
    writer, reader = FakeWriter(store), FakeReader(store)
    tiers.writer, tiers.reader = writer, reader
    a = list(range(8))
    cache(mem, a)
    mem.free(tree.evict(8))                 # to disk: 4 pages, writes queued
    writer.submit_orders(tiers)             # the step ran: the pages are in the queue
    tiers.moves_done()
    return tree, mem, tiers, store, writer, reader, a


def check(tree, mem):
    tree.check_invariants()
    mem.check_conservation()


def test_a_pending_node_is_loaded_from_the_queue_and_its_slots_wait_for_the_write():
    tree, mem, tiers, store, writer, reader, a = setup()
    assert len(tiers.pending_writes) == 4 and not store.pages
    check(tree, mem)
    lease = PrefixLease(mem)
    m = lease.acquire(a + [99])
    assert lease.load(m) == 8               # from the writer's queue, no read asked
    assert reader.asked_keys == []
    # The node is in the pool now; the disk tier is inclusive: its slots stay, as kept
    # copies, and their writes go on.
    assert len(tiers.kept) == 4 and not tiers.orphaned and tiers.alloc[DISK].num_free == 4
    check(tree, mem)
    writer.finish()
    tiers.collect_io()
    assert not tiers.orphaned and not tiers.pending_writes
    assert tiers.alloc[DISK].num_free == 4 and len(store.pages) == 4   # the copies' files
    tiers.forget(list(tree.iter_nodes()))          # a flush takes the copies with it
    assert tiers.alloc[DISK].num_free == 8 and not store.pages and not tiers.kept
    lease.release()
    check(tree, mem)


def test_a_node_half_written_loads_its_written_pages_from_disk_and_the_rest_from_the_queue():
    """The writer writes a node's pages one by one: when the tree hears of the first two
    before the last two, the node is still pending, and its load reads the two written
    pages and takes the other two from the queue (it once gave up on the whole node, and
    the path was recomputed: CI, test_engine_hybrid_tiers)."""
    tree, mem, tiers, store, writer, reader, a = setup()
    writer.finish(first=2)
    tiers.collect_io()
    assert len(tiers.pending_writes) == 2 and len(store.pages) == 2
    lease = PrefixLease(mem)
    with pytest.raises(ReadPending):
        lease.load(lease.acquire(a + [99]))
    lease.release()
    assert sorted(reader.asked_keys) == sorted(store.pages)     # only the written two
    reader.finish()
    lease = PrefixLease(mem)
    assert lease.load(lease.acquire(a + [99])) == 8
    (load,) = tiers.take_moves()
    assert [int.from_bytes(p, "little") for p in load.payloads] == load.src.tolist()
    lease.release()
    check(tree, mem)


def test_a_failed_write_drops_the_node_as_an_eviction():
    tree, mem, tiers, store, writer, reader, a = setup()
    node = tree.match_prefix(a).lower[0]
    first = int(node.pages[0]) - tiers.offset[DISK]
    writer.finish(fail={first})
    tiers.collect_io()
    assert tiers.counters.failed_writes == 1
    assert not tiers.nodes[DISK] and not tree.match_prefix(a).lower
    assert tiers.alloc[DISK].num_free == 8 and not store.pages
    check(tree, mem)


def test_an_admission_waits_for_its_reads_then_loads_them():
    tree, mem, tiers, store, writer, reader, a = setup()
    writer.finish()
    tiers.collect_io()
    assert not tiers.pending_writes and len(store.pages) == 4
    lease = PrefixLease(mem)
    m = lease.acquire(a + [99])
    with pytest.raises(ReadPending):
        lease.load(m)
    lease.release()
    assert len(reader.asked_keys) == 4 and len(tiers.reading) == 4
    check(tree, mem)
    # Asked again before the reads end: nothing is asked twice.
    lease = PrefixLease(mem)
    with pytest.raises(ReadPending):
        lease.load(lease.acquire(a + [99]))
    lease.release()
    assert len(reader.asked_keys) == 4
    reader.finish()
    lease = PrefixLease(mem)
    assert lease.load(lease.acquire(a + [99])) == 8
    assert not tiers.reading and not tiers.orphaned and reader.results == {}
    lease.release()
    check(tree, mem)


def test_a_node_dropped_while_its_read_is_in_flight_keeps_its_slots_until_the_read_ends():
    tree, mem, tiers, store, writer, reader, a = setup()
    writer.finish()
    tiers.collect_io()
    lease = PrefixLease(mem)
    with pytest.raises(ReadPending):
        lease.load(lease.acquire(a + [99]))
    lease.release()
    mem.flush_cache()                       # the disk node leaves while read
    assert len(tiers.orphaned) == 4 and tiers.alloc[DISK].num_free == 4
    check(tree, mem)
    reader.finish()
    tiers.collect_io()
    assert not tiers.orphaned and tiers.alloc[DISK].num_free == 8
    assert reader.results == {} and not store.pages
    check(tree, mem)
    assert np.all(tiers.alloc[DISK].free_page_ids() >= 0)
