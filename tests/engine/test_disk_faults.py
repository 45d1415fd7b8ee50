"""Disk faults under a serving engine (storage/disk_faults.py), injected as `OSError`s at
the storage boundary (the page file write, its fsync, its read): a full disk, a read-only
directory, an I/O error on write or read, a failed fsync. None fails a request: every reply
equals the uncached one, the fault is counted by kind, every tier's pages are conserved
after each request; once the fault clears, writes resume and pages are on disk again.

(No tmpfs: mounting needs privileges CI machines do not give; ENOSPC is injected instead.)
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from engine_helpers import collect, make_engine, wait_idle
from test_disk_writer_engine import PAGE, disk_files, expected  # noqa: F401 (fixture)
from test_engine_tiers import GREEDY, pool_for

from radixserve.cache.tier_types import Tier
from radixserve.storage import atomic_files, disk_store


class Faults:
    """Injected faults at the storage boundary: the page file write (`write_errno`), its
    fsync (`fsync_errno`), a page file read (`read_errno`); 0: no fault. `hits` counts the
    raised ones."""

    def __init__(self, monkeypatch):
        self.write_errno = self.fsync_errno = self.read_errno = 0
        self.hits = 0
        real_write = disk_store.write_atomic

        def write_atomic(path, chunks, sync_dir=False, **kw):
            self._fail(self.write_errno, f"write {path.name}")
            return real_write(path, chunks, sync_dir, **kw)

        def faulty_open(path, mode="r", *args, **kw):
            if "r" in mode and str(path).endswith(disk_store.PAGE_SUFFIX):
                self._fail(self.read_errno, f"read {path}")
            return open(path, mode, *args, **kw)
        monkeypatch.setattr(disk_store, "write_atomic", write_atomic)
        monkeypatch.setattr(disk_store, "open", faulty_open, raising=False)
        monkeypatch.setattr(atomic_files, "os", FaultyOs(self))

    def _fail(self, err: int, what: str) -> None:
        if err:
            self.hits += 1
            raise OSError(err, f"injected: {errno.errorcode[err]} on {what}")

    def clear(self) -> None:
        self.write_errno = self.fsync_errno = self.read_errno = 0


class FaultyOs:
    """`os` for atomic_files, whose fsync fails while `faults.fsync_errno` is set."""

    def __init__(self, faults: Faults):
        self.faults = faults

    def fsync(self, fd: int) -> None:
        self.faults._fail(self.faults.fsync_errno, "fsync")
        os.fsync(fd)

    def __getattr__(self, name):
        return getattr(os, name)


async def serve_all(engine, prompts) -> list[list[int]]:
    """Each prompt in turn, the disk's writes finished before the next; conservation after
    every request (every tier: free + held exactly once)."""
    tiers, got = engine.tiers, []
    for p in prompts:
        await asyncio.to_thread(tiers.writer.drain)
        got.append((await collect(engine.generate(p, GREEDY))).token_ids[0])
        await wait_idle(engine)
        engine.check_invariants()
    await asyncio.to_thread(tiers.writer.drain)
    tiers.lower.collect_io()
    engine.check_invariants()
    return got


WRITE_FAULTS = [("no_space", "write_errno", errno.ENOSPC), ("read_only", "write_errno", errno.EROFS),
                ("write_error", "write_errno", errno.EIO), ("fsync_error", "fsync_errno", errno.EIO)]


def test_disk_faults_never_fail_a_request_and_the_tier_resumes(
        model_fp32, expected, tmp_path, monkeypatch):  # noqa: F811
    prompts, replies = expected                 # A, five others, A (uncached replies)
    engine = make_engine(model_fp32, page_size=PAGE, kv_disk_dir=str(tmp_path),
                         kv_cache_tokens=pool_for(prompts) // PAGE * PAGE + 2 * PAGE + 16)
    faults = engine.persistence.store.faults
    faults.retry_s = 0.0                # probe at every write: resuming needs no waiting
    tiers = engine.tiers
    inject = Faults(monkeypatch)

    async def main():
        await engine.start()
        try:
            assert await serve_all(engine, prompts[:1]) == replies[:1]     # fills the pool
            for i, (kind, where, err) in enumerate(WRITE_FAULTS):
                # three requests in turn: the pool holds two, so older ones are demoted
                pair = [1 + (3 * i + k) % 5 for k in range(3)]
                before = inject.hits
                setattr(inject, where, err)
                assert await serve_all(engine, [prompts[j] for j in pair]) == \
                    [replies[j] for j in pair], kind               # no request failed
                assert inject.hits > before, kind
                assert faults.counts[kind] == inject.hits - before, kind
                assert faults.paused_kind == kind
                assert engine.stats().kv_disk.faults[kind] == faults.counts[kind]  # /metrics
                inject.clear()
            assert disk_files(tmp_path) == set()                    # nothing half-written
            assert tiers.lower.counters[Tier.DISK].loaded_tokens == 0
            # the faults cleared (space freed, ...): writes resume, A goes to disk
            assert await serve_all(engine, prompts[:-1]) == replies[:-1]
            assert faults.paused_kind is None and disk_files(tmp_path)
            # A comes back, but its page files cannot be read: dropped, recomputed
            inject.read_errno = errno.EIO
            loaded, hits = tiers.lower.counters[Tier.DISK].loaded_tokens, inject.hits
            assert await serve_all(engine, prompts[-1:]) == replies[-1:]
            assert inject.hits > hits and faults.counts["read_error"] == inject.hits - hits
            assert tiers.lower.counters[Tier.DISK].loaded_tokens == loaded  # recomputed
            assert faults.paused_kind is None                       # reads do not pause writes
        finally:
            inject.clear()
            await engine.shutdown()
    asyncio.run(main())


def test_a_save_the_disk_refuses_is_a_clear_error_counted_as_a_fault(
        model_fp32, expected, tmp_path, monkeypatch):  # noqa: F811
    from radixserve.engine.errors import DiskUnwritable
    from radixserve.server.errors import api_error_from

    prompts, replies = expected
    engine = make_engine(model_fp32, page_size=PAGE, kv_disk_dir=str(tmp_path))
    faults = engine.persistence.store.faults
    faults.retry_s = 0.0                # every write probes the disk: no waiting
    inject = Faults(monkeypatch)

    async def main():
        await engine.start()
        try:
            assert await serve_all(engine, prompts[:1]) == replies[:1]
            for err, kind, status in ((errno.EROFS, "read_only", 503),
                                      (errno.ENOSPC, "no_space", 507)):
                inject.write_errno = err            # the directory turned read-only / full
                with pytest.raises(DiskUnwritable) as refused:
                    await engine.save_cache()
                assert refused.value.kind == kind and faults.counts[kind] >= 1
                answer = api_error_from(refused.value)   # what POST /cache/save answers
                assert answer.status == status and kind in answer.message
                assert str(tmp_path) in answer.message
                inject.clear()
                # the server keeps serving, and pages stay conserved (serve_all checks)
                assert await serve_all(engine, prompts[1:2]) == replies[1:2]
            report = await engine.save_cache()      # writable again: the save works
            assert report["nodes"] > 0
        finally:
            inject.clear()
            await engine.shutdown()
    asyncio.run(main())
