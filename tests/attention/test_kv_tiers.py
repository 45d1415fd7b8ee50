"""TierMover: pages go pool -> host -> disk -> pool and come back bit for bit (scales too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.attention.kv_tiers import HostKVPool, TierMover
from radixserve.attention.page_bytes import page_payload_bytes as page_nbytes, pool_tensors
from radixserve.cache.tiers import DISK, HOST, POOL, DemoteOrder, LoadOrder
from radixserve.kv_sizing import KVFormat


class DictDisk:
    def __init__(self):
        self.pages = {}

    def write_page(self, key, payload):
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
    assert times.tokens == {"l3->l1": 8}
    after = [t[4:6] for t in pool_tensors(pool)]
    for a, b in zip(before, after):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if kv != "float32":
        assert pool.k_scale is not None             # scales were among the tensors moved
