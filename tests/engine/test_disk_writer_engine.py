"""The disk tier's page files are written off the step (storage/disk_writer.py): with the
writer held (a gate no write passes), steps still complete, demoted pages stay pending and
are served from the writer's queue, every tier's pages are conserved; once the gate opens,
the pages are durable files and the tree has heard so on its own thread. A write that fails
drops the page as an ordinary eviction, counted, and replies stay correct."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_helpers import collect, make_engine, wait_idle
from test_engine_tiers import GREEDY, pool_for, scenario

from radixserve.cache.tiers import DISK

PAGE = 16
GUARD_S = 300       # only a guard against a hang (a write on the step would block it)


class GatedPages:
    """Wraps the disk tier's pages: every write waits for `gate` (or fails with `error`)."""

    def __init__(self, inner, gate: threading.Event, error: Exception | None = None):
        self.inner, self.gate, self.error = inner, gate, error
        self.entered = threading.Event()

    def write_page(self, slot: int, payload: bytes) -> None:
        self.entered.set()
        self.gate.wait()
        if self.error is not None:
            raise self.error
        self.inner.write_page(slot, payload)


def engine_with_gate(model, tmp_path, prompts, error=None):
    pool = pool_for(prompts) // PAGE * PAGE + 2 * PAGE + 16
    engine = make_engine(model, page_size=PAGE, kv_cache_tokens=pool,
                         kv_disk_dir=str(tmp_path))
    writer = engine.tiers.writer
    gate = threading.Event()
    writer.target = GatedPages(writer.target, gate, error)
    return engine, writer, gate


def disk_files(tmp_path) -> set[str]:
    return {p.name for p in (tmp_path / "pages").glob("*.page")}


@pytest.fixture(scope="module")
def expected(model_fp32):
    engine = make_engine(model_fp32, disable_radix_cache=True, page_size=PAGE)
    prompts = scenario(engine)

    async def main():
        await engine.start()
        try:
            return [(await collect(engine.generate(p, GREEDY))).token_ids[0] for p in prompts]
        finally:
            await engine.shutdown()
    return prompts, asyncio.run(main())


def test_steps_run_while_the_writer_is_held_and_pages_become_files_after(
        model_fp32, expected, tmp_path):
    prompts, replies = expected
    engine, writer, gate = engine_with_gate(model_fp32, tmp_path, prompts)
    tiers = engine.tiers.lower

    async def main():
        await engine.start()
        try:
            got = []
            for p in prompts[:-1]:       # A, then the others push it out to disk
                out = await asyncio.wait_for(collect(engine.generate(p, GREEDY)), GUARD_S)
                got.append(out.token_ids[0])
                await wait_idle(engine)
                engine.check_invariants()       # every tier: free / held exactly once
            assert writer.target.entered.is_set()
            assert tiers.counters[DISK].demoted_tokens > 0
            # Nothing is durable: the gate holds the first write; the demoted nodes are
            # still pending, so they are not pushed out or reused, and no file exists.
            assert tiers.pending_writes
            assert disk_files(tmp_path) == set()
            pending_nodes = [n for n in tiers.nodes[DISK].values() if tiers._pending(n)]
            assert pending_nodes
            # A comes back while its pages are still queued: loaded from the queue.
            last = await asyncio.wait_for(collect(engine.generate(prompts[-1], GREEDY)),
                                          GUARD_S)
            got.append(last.token_ids[0])
            await wait_idle(engine)
            engine.check_invariants()
            assert got == replies
            assert last.final.usage.cached_tokens > 0
            assert tiers.counters[DISK].loaded_tokens > 0
            assert tiers.pending_writes             # still nothing written
            # Open the gate; wait for the queue to drain (an event, not a sleep).
            gate.set()
            await asyncio.to_thread(writer.drain)
            tiers.collect_io()
            assert not tiers.pending_writes and not tiers.orphaned
            engine.check_invariants()
            # Every disk node's pages are files now, and so are those of A, loaded back
            # while its writes were queued: the disk tier is inclusive, it keeps them.
            assert tiers.kept
            keys = [tiers.disk.key_of(s) for n in tiers.nodes[DISK].values()
                    for s in tiers.local(DISK, n.pages).tolist()]
            keys += [tiers.disk.key_of(s) for s in tiers.kept]
            assert keys and None not in keys
            assert {f"{k:016x}.page" for k in keys} == disk_files(tmp_path)
            held = sum(len(n.pages) for n in tiers.nodes[DISK].values()) + len(tiers.kept)
            assert tiers.alloc[DISK].num_free == tiers.capacity_pages(DISK) - held
        finally:
            gate.set()
            await engine.shutdown()
    asyncio.run(main())


def test_a_failed_write_drops_the_page_and_replies_stay_correct(model_fp32, expected,
                                                                   tmp_path):
    prompts, replies = expected
    engine, writer, gate = engine_with_gate(model_fp32, tmp_path, prompts,
                                            error=OSError(28, "No space left on device"))
    gate.set()
    tiers = engine.tiers.lower

    async def main():
        await engine.start()
        try:
            got = []
            for p in prompts:
                # Each write has failed before the next request comes: none is served.
                await asyncio.to_thread(writer.drain)
                got.append((await collect(engine.generate(p, GREEDY))).token_ids[0])
                await wait_idle(engine)
                engine.check_invariants()
            await asyncio.to_thread(writer.drain)
            tiers.collect_io()
            engine.check_invariants()
            assert got == replies
            assert tiers.counters.failed_writes > 0
            assert tiers.counters[DISK].loaded_tokens == 0
            assert not tiers.nodes[DISK] and not tiers.pending_writes
            assert tiers.alloc[DISK].num_free == tiers.capacity_pages(DISK)
            assert engine.stats().tiers.failed_disk_writes == tiers.counters.failed_writes
        finally:
            await engine.shutdown()
    asyncio.run(main())


def test_a_full_queue_drops_the_page_instead_of_waiting():
    """A slow disk is never waited on: with the queue full, `submit` (what the step calls)
    returns at once, the page is reported failed (recomputed when needed) and counted as
    queue_full; the queued pages are written in order once the disk moves."""
    from radixserve.storage.disk_writer import DiskWriter

    written: list[int] = []
    gate, entered = threading.Event(), threading.Event()

    class Target:
        def write_page(self, slot, payload):
            entered.set()
            gate.wait()
            written.append(slot)

    writer = DiskWriter(Target(), max_pages=1)
    writer.submit(1, b"a")
    entered.wait()              # the thread holds page 1, blocked in its write
    writer.submit(2, b"b")      # fills the queue
    writer.submit(3, b"c")      # returns: the disk is not waited on
    assert writer.held_page(2) == b"b"          # a queued page is readable meanwhile
    assert writer.held_page(3) is None
    assert writer.faults.counts["queue_full"] == 1
    done, failed = writer.take_finished()
    assert done == [] and failed == [3]
    gate.set()
    writer.drain()
    assert written == [1, 2]
    done, failed = writer.take_finished()
    assert done == [1, 2] and failed == []
    assert writer.held_page(1) is None          # reported: read it from disk now
    writer.close()


class GatedReads:
    """Wraps the disk tier's pages: every read waits for `gate`."""

    def __init__(self, inner, gate: threading.Event):
        self.inner, self.gate = inner, gate
        self.entered = threading.Event()

    def read_page(self, slot: int) -> bytes | None:
        self.entered.set()
        self.gate.wait()
        return self.inner.read_page(slot)


def engine_with_gated_reads(model, tmp_path, prompts):
    """An engine whose disk writes pass at once and whose disk reads, once `reads` is
    installed as the reader's source, wait for `gate`: (engine, writer, gate, reads)."""
    engine, writer, write_gate = engine_with_gate(model, tmp_path, prompts)
    write_gate.set()
    gate = threading.Event()
    return engine, writer, gate, GatedReads(engine.tiers.reader.source, gate)


async def serve_onto_disk(engine, writer, prompts) -> list:
    """Serve `prompts` one by one, then wait until their pages are written to disk; the
    first token of each reply."""
    first = []
    for p in prompts:
        first.append((await collect(engine.generate(p, GREEDY))).token_ids[0])
        await wait_idle(engine)
    await asyncio.to_thread(writer.drain)
    engine.tiers.lower.collect_io()
    assert engine.tiers.lower.nodes[DISK]
    return first


def test_disk_reads_run_off_the_event_loop_and_the_request_waits_for_them(
        model_fp32, expected, tmp_path):
    """A's prefix is on disk (durable); its reads are held by a gate. The event loop keeps
    running and steps another request to its end; A waits, then loads its prefix from
    disk once the reads pass and replies as without a cache. A watchdog opens the gate
    (and fails the test) if the reads ran on the loop and blocked it."""
    prompts, replies = expected
    engine, writer, gate, reads = engine_with_gated_reads(model_fp32, tmp_path, prompts)
    tiers = engine.tiers.lower
    watchdog_fired = threading.Event()
    watchdog = threading.Timer(GUARD_S, lambda: (watchdog_fired.set(), gate.set()))

    async def main():
        await engine.start()
        try:
            got = await serve_onto_disk(engine, writer, prompts[:-1])
            assert not tiers.pending_writes
            tiers.reader.source = reads
            watchdog.start()
            a = asyncio.create_task(collect(engine.generate(prompts[-1], GREEDY)))
            await asyncio.to_thread(reads.entered.wait)     # the loop is free meanwhile
            assert not watchdog_fired.is_set()
            other = list(range(1000, 1040))                 # nothing of it is cached
            await asyncio.wait_for(collect(engine.generate(other, GREEDY)), GUARD_S)
            assert not a.done() and not watchdog_fired.is_set()
            assert tiers.reading                            # A's reads are in flight
            engine.check_invariants()
            gate.set()
            last = await asyncio.wait_for(a, GUARD_S)
            got.append(last.token_ids[0])
            await wait_idle(engine)
            engine.check_invariants()
            assert got == replies
            assert tiers.counters[DISK].loaded_tokens > 0
            assert last.final.usage.cached_tokens >= tiers.counters[DISK].loaded_tokens
        finally:
            watchdog.cancel()
            gate.set()
            await engine.shutdown()
    asyncio.run(main())
    assert not watchdog_fired.is_set()


def test_a_request_aborted_while_its_disk_reads_wait_gives_back_everything(
        model_fp32, expected, tmp_path):
    """A's prefix is on disk and its reads are held by a gate; A is aborted while it waits.
    It ends with finish reason "abort", every tier's pages are conserved, and after the
    reads pass the same prompt is served correctly (loading from disk again)."""
    prompts, replies = expected
    engine, writer, gate, reads = engine_with_gated_reads(model_fp32, tmp_path, prompts)
    tiers = engine.tiers.lower

    async def main():
        await engine.start()
        try:
            await serve_onto_disk(engine, writer, prompts[:-1])
            tiers.reader.source = reads
            stream = engine.generate(prompts[-1], GREEDY, request_id="a")
            a = asyncio.create_task(collect(stream))
            await asyncio.wait_for(asyncio.to_thread(reads.entered.wait), GUARD_S)
            engine.abort("a")
            aborted = await asyncio.wait_for(a, GUARD_S)
            assert aborted.final.finish_reason == "abort"
            await wait_idle(engine)
            engine.check_invariants()                   # every tier: nothing held by A
            gate.set()
            again = await asyncio.wait_for(collect(engine.generate(prompts[-1], GREEDY)),
                                           GUARD_S)
            await wait_idle(engine)
            engine.check_invariants()
            assert again.token_ids[0] == replies[-1]
        finally:
            gate.set()
            await engine.shutdown()
    asyncio.run(main())
