"""TierMover: pages go pool -> host -> disk -> pool and come back bit for bit (scales too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.attention.kv_tiers import HostKVPool, TierMover
from radixserve.attention.page_bytes import page_payload_bytes as page_nbytes, pool_tensors
from radixserve.cache.tier_types import Move
from radixserve.cache.tiers import DISK, HOST, POOL, DemoteOrder, LoadOrder
from radixserve.kv_sizing import KVFormat


class DictDisk:
    def __init__(self):
        self.pages = {}

    def submit(self, key, payload):         # the disk writer's queue, written at once
        self.pages[key] = bytes(payload)


@pytest.mark.parametrize("kv", ["float32", "fp8_e4m3"])
def test_pages_round_trip_through_host_and_disk(kv):
    pool = KVPool(2, 6, 4, 2, 8, torch.float32, "cpu", kv_format=KVFormat(kv, kv))
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        slots = torch.arange(0, 8)                   # pages 0 and 1
        k = torch.randn(8, 2, 8, generator=g)
        pool.write(layer, slots, k, -k)
    before = [t[:2].clone() for t in pool_tensors(pool)]
    disk = DictDisk()
    mover = TierMover(pool, HostKVPool(pool, 3), disk)
    ids = lambda *xs: np.array(xs, dtype=np.int32)  # noqa: E731
    mover.run([DemoteOrder(POOL, ids(0, 1), HOST, ids(2, 0)),      # pool -> host
               DemoteOrder(HOST, ids(2, 0), DISK, ids(7, 9))])     # host -> disk
    assert sorted(disk.pages) == [7, 9]
    assert all(len(p) == page_nbytes(pool) for p in disk.pages.values())
    for t in pool_tensors(pool):
        t.view(torch.uint8)[:2].fill_(0)             # the pool pages are reused meanwhile
    times = mover.run([LoadOrder(DISK, ids(7, 9), ids(4, 5),
                                 (disk.pages[7], disk.pages[9]))])
    assert times.tokens == {Move(DISK, POOL): 8}
    after = [t[4:6] for t in pool_tensors(pool)]
    for a, b in zip(before, after):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if kv != "float32":
        assert pool.k_scale is not None             # scales were among the tensors moved


# ---- the side stream's bookkeeping, with a fake stream and event (runs on CPU) ----------

class FakeEvent:
    def __init__(self, log):
        self.log, self.complete, self.recorded_on = log, False, None

    def record(self, stream):
        self.recorded_on = stream

    def query(self):
        return self.complete

    def synchronize(self):
        self.log.append(("synchronize", self))
        self.complete = True

    def elapsed_time(self, end):
        return 2.0          # ms


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event))


class FakeOps:
    def __init__(self):
        self.log, self.events = [], []
        self._compute, self._side = FakeStream("compute", self.log), FakeStream("side", self.log)

    def compute(self):
        return self._compute

    def side(self):
        return self._side

    def use(self, stream):
        import contextlib
        self.log.append(("use", stream.name))
        return contextlib.nullcontext()

    def event(self):
        e = FakeEvent(self.log)
        self.events.append(e)
        return e


def filled_pool():
    pool = KVPool(2, 8, 4, 2, 8, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    for t in pool_tensors(pool):
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def test_side_stream_copies_are_pending_until_their_event_completes():
    pool = filled_pool()
    ops = FakeOps()
    disk = DictDisk()
    mover = TierMover(pool, HostKVPool(pool, 4), disk, streams=ops)
    ids = lambda *xs: np.array(xs, dtype=np.int32)  # noqa: E731
    before = [t[[1, 2]].clone() for t in pool_tensors(pool)]

    times = mover.run([DemoteOrder(POOL, ids(1, 2), HOST, ids(3, 0))])
    assert ("side", "wait_stream", "compute") in ops.log    # reads what compute wrote
    assert ("use", "side") in ops.log
    started, gathered, done = ops.events
    assert all(e.recorded_on is ops.side() for e in ops.events)
    # The compute stream waits for the gather (freed pool pages), not for the host copy.
    assert ("compute", "wait_event", gathered) in ops.log
    assert ("compute", "wait_event", done) not in ops.log
    assert mover.events.pending == 1 and times.tokens == {}
    for h, b in zip(mover.host.tensors, before):
        assert torch.equal(h[[3, 0]], b)
    # Pending until the event says done: poll (next run) leaves it, then reports it.
    assert mover.run([]).tokens == {} and mover.events.pending == 1
    done.complete = True
    times = mover.run([])
    assert mover.events.pending == 0 and times.tokens == {Move(POOL, HOST): 8}
    assert times.seconds[Move(POOL, HOST)] == pytest.approx(0.002)

    # A load: host -> pool on the side stream; compute waits for all of it.
    ops.events.clear()
    mover.run([LoadOrder(HOST, ids(3, 0), ids(6, 7))])
    started, done = ops.events
    assert ("compute", "wait_event", done) in ops.log
    for t, b in zip(pool_tensors(pool), before):
        assert torch.equal(t[[6, 7]], b)
    assert mover.events.pending == 1

    # Host -> disk reads host memory on the CPU: the pending copies are waited for first.
    ops.log.clear()
    mover.run([DemoteOrder(HOST, ids(3), DISK, ids(5))])
    assert ops.log[0] == ("side", "wait_stream", "compute")
    assert ("synchronize", done) in ops.log and mover.events.pending == 0
    assert len(disk.pages[5]) == page_nbytes(pool)


def test_the_cpu_path_has_no_side_stream():
    pool = filled_pool()
    mover = TierMover(pool, HostKVPool(pool, 2), None)
    assert mover.streams is None
