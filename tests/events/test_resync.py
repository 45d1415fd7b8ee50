"""The engine's events path (tree facts replayed on the publisher's thread, stream.py) when
batches are lost: a queue that overflows behind a stuck thread, or a batch that fails on
the thread, is replaced by a snapshot of the whole tree, so a consumer that applies every
batch it gets still ends with the engine's exact index."""

from __future__ import annotations

import threading

import pytest

from radixserve.cache import PagedMemory, RadixCache
from radixserve.events.stream import KVEvents, KVEventsConfig
from radixserve.events.subscriber import EventSubscriber
from tests.events.conftest import LOCAL, drain
from tests.events.consumers import DynamoIndex, LlmdIndex
from tests.events.test_golden import run

BLOCK = 4
SYSTEM = list(range(100, 110))
PROMPTS = [SYSTEM + [i] * (3 + i) for i in range(12)] + [[7] * 13, SYSTEM[:6] + [1, 2, 3]]


def serve_prompts(kv: KVEvents, tree: RadixCache, mem: PagedMemory, flush=None) -> None:
    """The PROMPTS requests (two namespaces, evictions: 64 pages are too few), `flush`
    (default: kv.flush) after each."""
    for i, p in enumerate(PROMPTS):
        run(tree, mem, p, "tenant" if i % 4 == 0 else None)
        if i % 5 == 4:
            mem.free(tree.evict(20))
        (flush or kv.flush)()


def serve_and_check(kv: KVEvents, tree: RadixCache, mem: PagedMemory, flush=None) -> list:
    """serve_prompts (`flush` after each), then an index built from every batch must match
    the tree for every prompt."""
    serve_prompts(kv, tree, mem, flush)
    assert kv.publisher.wait_idle(30)
    kv.flush()          # the next step's flush: it sees a failure the thread reported
    sub = EventSubscriber(kv.publisher.endpoint, kv.publisher.replay_endpoint)
    try:
        got = drain(sub, kv.publisher, kv.publisher.sent_when_idle())
    finally:
        sub.close()
    indexes = [LlmdIndex(BLOCK), DynamoIndex(BLOCK)]
    for r in got:
        for index in indexes:
            index.apply(r.batch)
    for p in PROMPTS:
        for ns in (None, "tenant"):
            want = tree.peek_prefix(p, ns) // BLOCK
            for index in indexes:
                assert index.matched_blocks(p, ns) == want, (type(index).__name__, p, ns)
    tree.check_invariants()
    mem.check_conservation([])
    return got


def new_events(queue_batches: int = 4096):
    tree = RadixCache(page_size=1)
    mem = PagedMemory(64, tree)
    kv = KVEvents(tree, KVEventsConfig(LOCAL, LOCAL, block_size=BLOCK, publisher="thread"),
                  "cpu", queue_batches=queue_batches)
    return kv, tree, mem


def hold_sends(kv: KVEvents) -> threading.Event:
    """Make the publisher's thread hang in its first send (the start's AllBlocksCleared)
    until the returned event is set; returns once the thread is inside it."""
    pub = kv.publisher
    release, inside = threading.Event(), threading.Event()
    real_send = pub._send

    def held_send(batch):
        inside.set()
        release.wait()
        real_send(batch)

    pub._send = held_send
    assert inside.wait(30)
    return release


def test_overflow_behind_a_stuck_thread_resyncs_with_a_snapshot():
    kv, tree, mem = new_events(queue_batches=3)
    pub = kv.publisher
    stuck = hold_sends(kv)
    try:
        for i, p in enumerate(PROMPTS[:8]):     # 8 flushes behind a queue of 3
            run(tree, mem, p)
            kv.flush()
        assert pub.stats.dropped_batches > 0
        stuck.set()
        got = serve_and_check(kv, tree, mem)
        kinds = [type(e).__name__ for r in got for e in r.batch.events]
        # The start's clear, then a snapshot's: the dropped batches were replaced.
        assert kinds.count("AllBlocksCleared") >= 2
    finally:
        stuck.set()
        kv.close()


def test_a_batch_that_fails_on_the_thread_is_followed_by_a_snapshot():
    kv, tree, mem = new_events()
    real = kv.replay.apply
    calls = {"n": 0}

    def failing_once(facts):
        calls["n"] += 1
        if calls["n"] == 3:             # the third batch's facts are lost half-applied
            real(facts[: len(facts) // 2])
            raise RuntimeError("injected failure")
        real(facts)

    kv.replay.apply = failing_once
    flush = kv.flush

    def flush_alone():          # one batch per flush (a thread behind joins queued ones)
        flush()
        assert kv.publisher.wait_idle(30)

    kv.flush = flush_alone
    try:
        got = serve_and_check(kv, tree, mem)
        assert calls["n"] > 3 and not kv.publisher.resync_wanted
        kinds = [type(e).__name__ for r in got for e in r.batch.events]
        assert kinds.count("AllBlocksCleared") == 2     # the start's and the snapshot's
    finally:
        kv.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_subscriber_across_a_restart_ends_with_the_new_index(tmp_path, mode):
    """An engine restarts on the same endpoints: its numbers continue above the old ones,
    so the subscriber sees a gap, the replay gives the new stream from its start (an
    AllBlocksCleared), and the index holds exactly the new engine's blocks."""
    config = KVEventsConfig(f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay",
                            block_size=BLOCK, publisher=mode)
    indexes = [LlmdIndex(BLOCK), DynamoIndex(BLOCK)]
    old_prompts, new_prompts = PROMPTS[:6], PROMPTS[6:]
    sub = None
    trees = []
    for prompts in (old_prompts, new_prompts):
        tree = RadixCache(page_size=1)
        mem = PagedMemory(256, tree)
        kv = KVEvents(tree, config, "cpu")
        sub = sub or EventSubscriber(config.endpoint, config.replay_endpoint)
        try:
            for p in prompts:
                run(tree, mem, p)
                kv.flush()
            for r in drain(sub, kv.publisher, kv.publisher.sent_when_idle()):
                for index in indexes:
                    index.apply(r.batch)
        finally:
            kv.close()
        trees.append(tree)
    sub.close()
    assert sub.restarts == 1 and sub.lost == 0
    for p in PROMPTS:
        want = trees[1].peek_prefix(p) // BLOCK     # the old engine's blocks are gone
        for index in indexes:
            assert index.matched_blocks(p, None) == want, (type(index).__name__, p)
    assert any(trees[0].peek_prefix(p) // BLOCK for p in old_prompts)


def test_steps_queued_behind_a_busy_thread_make_one_batch():
    """Facts of several flushes queued while the thread was busy are replayed as one batch
    (one encode, one send): fewer batches, the same index (serve_and_check)."""
    kv, tree, mem = new_events()
    pub = kv.publisher
    busy = hold_sends(kv)
    try:
        for p in PROMPTS[:6]:
            run(tree, mem, p)
            kv.flush()
        assert pub.queued() == 6
        busy.set()
        assert pub.wait_idle(30)
        assert pub.stats.published_batches == 2 and pub.stats.dropped_batches == 0
        serve_and_check(kv, tree, mem)
    finally:
        busy.set()
        kv.close()
