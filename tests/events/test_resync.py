"""The engine's events path (tree facts replayed on the publisher's thread, stream.py) when
batches are lost: a queue that overflows behind a stuck thread, or a batch that fails on
the thread, is replaced by a snapshot of the whole tree, so a consumer that applies every
batch it gets still ends with the engine's exact index."""

from __future__ import annotations

import threading

from radixserve.cache import PagedMemory, RadixCache
from radixserve.events.stream import KVEvents, KVEventsConfig
from radixserve.events.subscriber import EventSubscriber
from tests.events.conftest import LOCAL, drain
from tests.events.consumers import DynamoIndex, LlmdIndex
from tests.events.test_golden import run

BLOCK = 4
SYSTEM = list(range(100, 110))
PROMPTS = [SYSTEM + [i] * (3 + i) for i in range(12)] + [[7] * 13, SYSTEM[:6] + [1, 2, 3]]


def serve_and_check(kv: KVEvents, tree: RadixCache, mem: PagedMemory) -> list:
    """Requests (two namespaces, evictions: 64 pages are too few), a flush after each,
    then an index built from every batch must match the tree for every prompt."""
    for i, p in enumerate(PROMPTS):
        run(tree, mem, p, "tenant" if i % 4 == 0 else None)
        if i % 5 == 4:
            mem.free(tree.evict(20))
        kv.flush()
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
    kv = KVEvents(tree, KVEventsConfig(LOCAL, LOCAL, block_size=BLOCK), "cpu",
                  queue_batches=queue_batches)
    return kv, tree, mem


def test_overflow_behind_a_stuck_thread_resyncs_with_a_snapshot():
    kv, tree, mem = new_events(queue_batches=3)
    pub = kv.publisher
    stuck, inside = threading.Event(), threading.Event()
    real_send = pub._send

    def stuck_send(batch):              # the first send hangs until released
        inside.set()
        stuck.wait()
        real_send(batch)

    pub._send = stuck_send
    try:
        assert inside.wait(30)          # the thread holds the start's AllBlocksCleared
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
    real = kv.replay.batch
    calls = {"n": 0}

    def failing_once(facts):
        calls["n"] += 1
        if calls["n"] == 3:             # the third batch's facts are lost half-applied
            kv.replay.apply(facts[: len(facts) // 2])
            raise RuntimeError("injected failure")
        return real(facts)

    kv.publisher._prepare = failing_once
    try:
        got = serve_and_check(kv, tree, mem)
        assert calls["n"] > 3 and not kv.publisher.resync_wanted
        kinds = [type(e).__name__ for r in got for e in r.batch.events]
        assert kinds.count("AllBlocksCleared") == 2     # the start's and the snapshot's
    finally:
        kv.close()
