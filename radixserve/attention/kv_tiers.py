"""The KV data of the lower tiers: host slots (L2), disk pages (L3), and the mover.

`HostKVPool` holds page slots in host memory with the pool's layout (every layer's K and
V, and the 8-bit scales beside them when the pool is quantized, so a page decodes the same
after a round trip); on CUDA it is pinned, so copies to and from the GPU run as DMA.
A disk page is the same data as bytes, in the one layout `page_bytes` defines.

`TierMover.run(moves)` executes the cache's DemoteOrder / LoadOrder list on the compute
thread (on CUDA, pool <-> host copies on a side stream with events: copy_stream.py),
strictly in issue order (cache/tiers.py says why that order is safe), each order
batched over its pages: one gather and one scatter per tensor. The runner calls it at the
start of a step, before copy-on-write and the forward pass: pool pages an eviction freed
are read before the step writes into them. A demotion to disk copies the pages' bytes out
and hands them to the disk writer's queue (storage/disk_writer.py); the file is written
off the step, on the writer's thread. A hybrid model's windows named by the order go with
them (`window_pool`), so the disk tier's journal carries a page's window with it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from radixserve.attention.copy_stream import CopyEvents, CudaStreamOps, PendingCopy, StreamOps
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.page_bytes import (bytes_to_pages, page_payload_bytes,
                                             pages_to_bytes, pool_tensors, rows_to_bytes)
from radixserve.cache.tier_types import MoveTimes, Tier
from radixserve.cache.tiers import DISK, HOST, POOL, DemoteOrder, LoadOrder
from radixserve.cache.window_files import WindowLoad

__all__ = ["HostKVPool", "MoveTimes", "PageWriter", "TierMover"]


class PageWriter(Protocol):
    """Takes a demoted page's bytes for the disk (storage/disk_writer.py: DiskWriter,
    whose thread writes them; blocks while its queue is full)."""

    def submit(self, slot: int, payload: bytes, window: bytes | None = None) -> None: ...


class HostKVPool:
    """`num_slots` page slots in host memory, shaped like the pool's pages."""

    def __init__(self, pool: KVPool, num_slots: int):
        pin = pool.device.type == "cuda" and torch.cuda.is_available()
        self.num_slots = num_slots
        self.tensors = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                        for t in pool_tensors(pool)]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class TierMover:
    """Runs the orders. `streams` (default: a side stream when the pool is on CUDA and
    there is a host tier; None on CPU) moves pool <-> host copies off the compute stream
    (attention/copy_stream.py); everything else runs on the compute stream, synchronously."""

    def __init__(self, pool: KVPool, host: HostKVPool | None, disk: PageWriter | None,
                 streams: StreamOps | None = None, window_pool: KVPool | None = None):
        self.pool = pool
        self.window_pool = window_pool      # a hybrid model's: windows go to disk beside pages
        self.pool_tensors = pool_tensors(pool)
        self.host = host
        self.disk = disk
        self.device = pool.device
        if streams is None and host is not None and self.device.type == "cuda":
            streams = CudaStreamOps(self.device)
        self.streams = streams
        self.events = CopyEvents()

    def wait_copies(self) -> None:
        """Block until the side stream's copies are done (before the CPU reads host
        memory: a save's copy of host pages)."""
        self.events.wait()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page as a disk page holds it."""
        return page_payload_bytes(self.pool)

    def copy_out(self, tier: Tier, slots: np.ndarray) -> list[bytes]:
        """Pages of the pool or host memory (`slots` of `tier`) as disk-page bytes, for
        the cache saver (compute thread; waits for side-stream copies first)."""
        self.wait_copies()
        if tier == POOL:
            return pages_to_bytes(self.pool, slots)
        return rows_to_bytes(self.host.tensors, slots)

    def run(self, moves: Sequence[DemoteOrder | LoadOrder | WindowLoad]) -> MoveTimes:
        times = MoveTimes()
        ps = self.pool.page_size
        if self.streams is not None:
            self._finished(times, self.events.poll())
            # The side stream reads pool pages the compute stream wrote before this step.
            self.streams.side().wait_stream(self.streams.compute())
        for mv in moves:
            if isinstance(mv, WindowLoad):      # a hybrid model's windows, from disk files
                bytes_to_pages(self.window_pool, mv.pages.tolist(), mv.payloads)
                continue
            if self.streams is not None and self._host_only(mv):
                self._side_copy(mv, ps)
                continue
            if self.streams is not None:    # the CPU touches host memory or pool bytes
                self._finished(times, self.events.wait())
            started = time.perf_counter()
            if isinstance(mv, DemoteOrder):
                self._demote(mv)
                n = len(mv.src)
            else:
                self._load(mv)
                n = len(mv.dst)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            times.add(mv.move, n * ps, time.perf_counter() - started)
        return times

    # ------------------------------------------------------------------ side stream
    @staticmethod
    def _host_only(mv: DemoteOrder | LoadOrder) -> bool:
        """Pool <-> host memory, the copies the side stream runs."""
        if isinstance(mv, DemoteOrder):
            return mv.src_tier == POOL and mv.dst_tier == HOST
        return mv.src_tier == HOST

    def _side_copy(self, mv: DemoteOrder | LoadOrder, page_size: int) -> None:
        """One order on the side stream; the compute stream waits for what it needs."""
        ops = self.streams
        side, compute = ops.side(), ops.compute()
        started = ops.event()
        started.record(side)
        demote = isinstance(mv, DemoteOrder)
        with ops.use(side):
            if demote:      # gather from the pool, then device -> pinned host, per slot
                keep = self._gather(POOL, mv.src)
                gathered = ops.event()
                gathered.record(side)
                slots = mv.dst.tolist()
                for t, rows in zip(self.host.tensors, keep):
                    for i, slot in enumerate(slots):
                        t[slot].copy_(rows[i], non_blocking=True)
            else:           # pinned host -> device staging, then scatter into the pool
                n = len(mv.src)
                keep = [torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=self.device)
                        for t in self.pool_tensors]
                slots = mv.src.tolist()
                for staged, t in zip(keep, self.host.tensors):
                    for i, slot in enumerate(slots):
                        staged[i].copy_(t[slot], non_blocking=True)
                self._scatter(POOL, mv.dst, keep)
        done = ops.event()
        done.record(side)
        # Demote: the forward may overwrite the freed pool pages once the gather read them.
        # Load: the prefill reads the loaded pages.
        compute.wait_event(gathered if demote else done)
        self.events.add(PendingCopy(mv.move, len(mv.src) * page_size, started, done, keep))

    @staticmethod
    def _finished(times: MoveTimes, copies: list[PendingCopy]) -> None:
        """Completed side-stream copies: their GPU time (elapsed_time is in ms)."""
        for c in copies:
            times.add(c.key, c.tokens, c.started.elapsed_time(c.done) / 1000.0)

    # ------------------------------------------------------------------ directions
    def _tensors(self, tier: Tier) -> list[torch.Tensor]:
        return self.pool_tensors if tier == POOL else self.host.tensors

    def _gather(self, tier: Tier, ids: np.ndarray) -> list[torch.Tensor]:
        """Each tensor's rows `ids` of a pool or host tier (on that tier's device)."""
        tensors = self._tensors(tier)
        index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        if tier == POOL:
            index = index.to(self.device)
        return [t.index_select(0, index) for t in tensors]

    def _scatter(self, tier: Tier, ids: np.ndarray, rows: list[torch.Tensor]) -> None:
        tensors = self._tensors(tier)
        index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        if tier == POOL:
            index = index.to(self.device)
        for t, r in zip(tensors, rows):
            r = r.to(t.device, non_blocking=True) if r.device != t.device else r
            if t.dtype.itemsize == 1 and t.dtype != torch.uint8:
                # index_copy_ has no fp8 kernel on every device: move the same bytes as uint8
                t.view(torch.uint8).index_copy_(0, index, r.view(torch.uint8))
            else:
                t.index_copy_(0, index, r)

    def _demote(self, mv: DemoteOrder) -> None:
        if mv.dst_tier == HOST:
            self._scatter(HOST, mv.dst, self._gather(mv.src_tier, mv.src))
            return
        assert mv.dst_tier == DISK
        # The bytes are copied out here, before the step reuses the source pages; the
        # writer thread makes them durable (the tree hears of it on its own thread).
        payloads = rows_to_bytes(self._tensors(mv.src_tier), mv.src.tolist())
        windows = self._window_bytes(mv.windows, len(payloads))
        for key, payload, window in zip(mv.dst.tolist(), payloads, windows):
            if window is None:
                self.disk.submit(key, payload)
            else:
                self.disk.submit(key, payload, window)

    def _window_bytes(self, pages: np.ndarray | None, n: int) -> list[bytes | None]:
        """The windowed pool's pages (-1: none) as bytes, None where there is none."""
        out: list[bytes | None] = [None] * n
        if pages is None or self.window_pool is None:
            return out
        held = np.flatnonzero(pages >= 0)
        for i, payload in zip(held.tolist(),
                              pages_to_bytes(self.window_pool, pages[held].tolist())):
            out[i] = payload
        return out

    def _load(self, mv: LoadOrder) -> None:
        if mv.src_tier == HOST:
            self._scatter(POOL, mv.dst, self._gather(HOST, mv.src))
        else:
            bytes_to_pages(self.pool, mv.dst.tolist(), mv.payloads)
