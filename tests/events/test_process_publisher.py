"""The publisher process (`--kv-events-publisher process`, events/process_publisher.py and
child.py): it sends the very events the thread mode sends, in both encodings; a stopped
child never blocks the engine (its bounded queue drops the oldest frames, counted, then a
snapshot resyncs the consumers); a child that dies is logged, counted and restarted (its
first batch a snapshot, so a subscriber's index matches the tree again), up to a bound
past which the engine runs on without events; one that cannot bind fails the start with
its reason; close reaps it."""

from __future__ import annotations

import logging
import os
import signal
import time

import msgspec
import pytest
import zmq

from radixserve.cache import PagedMemory, RadixCache
from radixserve.events.stream import KVEvents, KVEventsConfig
from radixserve.events.subscriber import EventSubscriber
from radixserve.server.metrics import kv_events_metrics
from tests.events.conftest import LOCAL, drain
from tests.events.consumers import DynamoIndex, LlmdIndex
from tests.events.test_golden import run
from tests.events.test_resync import BLOCK, PROMPTS, serve_and_check, serve_prompts


def new_events(mode: str, encoding: str = "array", pages: int = 64, **options):
    tree = RadixCache(page_size=1)
    mem = PagedMemory(pages, tree)
    config = KVEventsConfig(LOCAL, LOCAL, block_size=BLOCK, encoding=encoding,
                            publisher=mode)
    return KVEvents(tree, config, "cpu", **options), tree, mem


def stream_of(mode: str, encoding: str) -> tuple[list[bytes], KVEvents]:
    """The PROMPTS scenario (two namespaces, evictions), one batch per flush; every
    batch's events encoded (the batch's `ts` left out: it is the time it was made)."""
    kv, tree, mem = new_events(mode, encoding)
    sub = EventSubscriber(kv.publisher.endpoint, kv.publisher.replay_endpoint,
                          encoding=encoding)
    def flush_alone() -> None:
        kv.flush()
        assert kv.publisher.wait_idle(30)

    try:
        assert kv.publisher.wait_idle(30)               # the start's clear: a batch alone
        serve_prompts(kv, tree, mem, flush_alone)
        got = drain(sub, kv.publisher, kv.publisher.sent_when_idle())
    finally:
        sub.close()
        kv.close()
    encode = msgspec.msgpack.Encoder().encode
    return [encode(r.batch.events) for r in got], kv


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_the_process_sends_the_threads_events_byte_for_byte(encoding):
    by_thread, _ = stream_of("thread", encoding)
    by_process, kv = stream_of("process", encoding)
    assert len(by_thread) == len(PROMPTS) + 1           # the start's clear, one per flush
    assert by_process == by_thread
    pub = kv.publisher
    assert not pub.child_imported_torch
    assert pub.process.returncode == 0                  # close: it ended by itself, reaped
    stats = kv.stats                                    # read back after close
    assert stats.published_batches == len(PROMPTS) + 1 and stats.dropped_batches == 0
    assert stats.cpu_s > 0 and stats.publisher_exits == 0


def test_a_stopped_process_never_blocks_the_engine_and_resyncs():
    # A small ring and queue: the child, stopped, stops draining; the writer waits for
    # room (off the engine's thread), the queue drops its oldest frames.
    kv, tree, mem = new_events("process", pages=4096, queue_batches=3, ring_bytes=4096)
    pub = kv.publisher
    assert pub.wait_idle(30)
    os.kill(pub.process.pid, signal.SIGSTOP)
    try:
        for i in range(12):             # ~2.4 kB of facts a flush, 12 behind a 4 kB ring
            run(tree, mem, [5000 + 300 * i + t for t in range(300)])
            kv.flush()                  # returns at once every time (else the test hangs)
        assert pub.stats.dropped_batches > 0 and pub.queued() <= 3
    finally:
        os.kill(pub.process.pid, signal.SIGCONT)
    try:
        got = serve_and_check(kv, tree, mem)
        kinds = [type(e).__name__ for r in got for e in r.batch.events]
        # The start's clear, then a snapshot's: the dropped frames were replaced.
        assert kinds.count("AllBlocksCleared") >= 2
    finally:
        kv.close()
    assert pub.process.returncode == 0


def test_a_process_that_dies_past_the_restart_bound_leaves_the_engine_running(caplog):
    kv, tree, mem = new_events("process")
    pub = kv.publisher
    pub.restart_budget.max_restarts = 0     # the bound reached: no restart
    try:
        run(tree, mem, PROMPTS[0])
        kv.flush()
        assert pub.wait_idle(30)
        pub.process.kill()
        assert pub.process.wait(30) == -signal.SIGKILL
        with caplog.at_level(logging.ERROR, logger="radixserve.events.process_publisher"):
            for p in PROMPTS[1:]:       # the engine goes on: nothing raises, nothing waits
                run(tree, mem, p)
                kv.flush()
            stats = kv.stats
        assert stats.publisher_exits == 1 and stats.publisher_restarts == 0
        assert stats.dropped_batches == len(PROMPTS) - 1    # every frame after the kill
        assert sum("publisher process" in r.message for r in caplog.records) == 1
        names = {m.name: m.samples[0].value for m in kv_events_metrics(stats)}
        assert names["radixserve_kv_events_publisher_exits"] == 1
        assert names["radixserve_kv_events_publisher_cpu_seconds"] > 0
        assert not pub.wait_idle(1)     # gone: it answers at once, never hangs
    finally:
        kv.close()                      # returns at once
    mem.check_conservation([])


def test_a_process_that_cannot_bind_fails_the_start_with_its_reason():
    taken = zmq.Context.instance().socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    tree = RadixCache(page_size=1)
    try:
        config = KVEventsConfig(LOCAL, f"tcp://127.0.0.1:{port}", publisher="process")
        with pytest.raises(RuntimeError, match="did not start: ZMQError: Address already"):
            KVEvents(tree, config, "cpu")
        assert tree.observer is None        # nothing attached: the engine did not start
    finally:
        taken.close(linger=0)


def test_the_process_drains_at_the_hand_overs_pace_one_wake_a_frame():
    # Its wake-ups preempted the engine's thread when it polled every 1 ms (child.py): it
    # drains the ring at the hand-over's pace, so about once a frame. Counted by the
    # kernel (its voluntary context switches), with no subscriber (a PUB nobody reads
    # sends nothing, so no ZeroMQ thread wakes).
    kv, tree, mem = new_events("process", pages=4096)
    pub = kv.publisher
    try:
        assert pub.wait_idle(30)
        before = pub.child_wakes()
        for i in range(20):
            run(tree, mem, [7000 + 40 * i + t for t in range(40)])
            kv.flush()
            assert pub.wait_idle(30)    # up to a drain period of the engine's polling
        wakes = pub.child_wakes() - before
        assert 20 <= wakes <= 30, wakes
    finally:
        kv.close()


def test_a_sleeping_process_is_woken_by_one_doorbell():
    """Idle, the child says it sleeps and waits on its pipe: the next paced hand-over
    (after_step, which rings only a sleeper) rings it once, a byte, and it drains the
    frame; the engine going idle (flush) rings it whether it sleeps or not."""
    kv, tree, mem = new_events("process", pages=4096)
    pub = kv.publisher
    child = pub._child
    try:
        assert pub.wait_idle(30)
        assert wait_for(child.ring.child_sleeping)
        rung = child.doorbells          # the start's clear rang (a flush)
        run(tree, mem, list(range(5000, 5040)))
        kv.after_step()                 # its interval passed while the child fell asleep
        assert pub.wait_idle(30) and child.doorbells == rung + 1
        run(tree, mem, list(range(6000, 6040)))
        kv.flush()
        assert pub.wait_idle(30) and child.doorbells == rung + 2
        assert pub.stats.dropped_batches == 0
    finally:
        kv.close()


def wait_for(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_killed_process_is_restarted_and_a_subscriber_matches_the_tree_again(caplog):
    """SIGKILL on the child: the next write finds it gone, a new one starts on the same
    endpoints, its first batch is a clear and the whole tree (the steps meanwhile were
    dropped), numbered above the old stream: the subscriber sees a restart, not a loss,
    and its index predicts the tree's real match lengths."""
    kv, tree, mem = new_events("process", pages=256)
    pub = kv.publisher
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
    indexes = [LlmdIndex(BLOCK), DynamoIndex(BLOCK)]

    def take_all() -> list:
        got = drain(sub, pub, pub.sent_when_idle())
        for r in got:
            for index in indexes:
                index.apply(r.batch)
        return got

    try:
        for p in PROMPTS[:5]:
            run(tree, mem, p)
            kv.flush()
        take_all()
        old_pid, old_first = pub.process.pid, pub.first_seq
        pub.process.kill()
        assert pub.process.wait(30) == -signal.SIGKILL
        with caplog.at_level(logging.WARNING, logger="radixserve.events.process_publisher"):
            run(tree, mem, PROMPTS[5])
            kv.flush()                  # the write fails: noticed, restarting
            assert pub.wait_restarted(60)
            run(tree, mem, PROMPTS[6])  # its facts are in the snapshot, not a frame
            kv.flush()                  # takes the new child in: the snapshot first
            for p in PROMPTS[7:]:
                run(tree, mem, p)
                kv.flush()
            got = take_all()
        assert pub.process.pid != old_pid and pub.first_seq > old_first
        assert type(got[0].batch.events[0]).__name__ == "AllBlocksCleared"
        assert sub.restarts == 1 and sub.lost == 0
        for p in PROMPTS:
            want = tree.peek_prefix(p) // BLOCK
            for index in indexes:
                assert index.matched_blocks(p, None) == want, (type(index).__name__, p)
        stats = kv.stats
        assert stats.publisher_exits == 1 and stats.publisher_restarts == 1
        assert stats.dropped_batches == 1       # PROMPTS[5]'s, lost with the old child
        assert stats.published_batches >= 2     # summed over both children
        names = {m.name: m.samples[0].value for m in kv_events_metrics(stats)}
        assert names["radixserve_kv_events_publisher_restarts"] == 1
        logged = [r.message for r in caplog.records]
        assert sum("restarting it" in m for m in logged) == 1
        assert sum("restarted (pid" in m for m in logged) == 1
    finally:
        sub.close()
        kv.close()
    assert pub.process.returncode == 0
    tree.check_invariants()
    mem.check_conservation([])


def test_restarts_are_bounded_per_window():
    kv, tree, mem = new_events("process")
    pub = kv.publisher
    pub.restart_budget.max_restarts = 1
    try:
        for round_ in range(2):
            pub.process.kill()
            pub.process.wait(30)
            run(tree, mem, PROMPTS[round_])
            kv.flush()                  # noticed
            if round_ == 0:
                assert pub.wait_restarted(60)
                kv.flush()              # taken in (a snapshot)
                assert pub.wait_idle(30)
        assert pub.exited() and not pub.wait_restarted(0)
        assert kv.stats.publisher_exits == 2 and kv.stats.publisher_restarts == 1
    finally:
        kv.close()
