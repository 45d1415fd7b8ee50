"""Consistency fuzz: a router that knows a replica only through its KV events predicts the
replica's real prefix match, in whole blocks, for every request.

The real cache runs without a model (PagedMemory, PrefixLease, LowerTiers with host and
disk tiers over an in-memory page store: the server's tier code), under random operations
(20k in the suite, 100k with scripts/fuzz_kv_events.py): requests with shared prefixes in
two namespaces (kept or released, loading host/disk hits or not), evictions that demote, steps that run the queued moves,
flushes of everything and of a namespace, restarts that rebuild the disk tier from its
index, and a subscriber that goes away and catches up through the replay socket. Batches
go over real ZeroMQ sockets on 127.0.0.1. Each request's engine match (pool + host + disk,
as the lease's acquire found it) is recorded with its place in the stream (batches
published before it, events gathered since: `TreeFacts.mark`); the consumer, applying
the stream event by event, checks its prediction at exactly that place, for llm-d's keys
and Dynamo's. Pages are conserved after every scenario. The events are made as the
engine makes them (events/stream.py): the tree's observer records raw facts, replayed
into a shadow tree and BlockEvents at each flush (here on the fuzz's own thread), after
the trip the publisher process's facts take: one msgpack frame each flush, read back
through a FrameReader (events/fact_messages.py).
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from radixserve.cache import OutOfPages, PagedMemory, RadixCache
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.tiers import DISK, DemoteOrder, LowerTiers
from radixserve.events.block_events import BlockEvents, media_for
from radixserve.events.fact_messages import FactEncoder, FrameReader, decode_facts
from radixserve.events.publisher import EventPublisher
from radixserve.events.schema import ENCODINGS
from radixserve.events.tree_facts import FactReplay, TreeFacts
from radixserve.events.subscriber import EventSubscriber
from tests.events.conftest import LOCAL
from tests.events.consumers import DynamoIndex, LlmdIndex

NAMESPACES = [None, None, "tenant-b"]


class FakeDisk:
    """The disk tier's page store: one payload per key (written by the demote orders)."""

    def __init__(self):
        self.pages: dict[int, bytes] = {}

    def write_page(self, key: int, payload: bytes) -> None:
        self.pages[key] = payload

    def read_page(self, key: int) -> bytes | None:
        return self.pages.get(key)

    def drop_page(self, key: int) -> None:
        self.pages.pop(key, None)


class Replica:
    """The cache of one engine without a model, publishing its events."""

    def __init__(self, ps: int, block: int, encoding: str, publisher: EventPublisher,
                 disk: FakeDisk, pool: int = 40, host: int = 16, disk_pages: int = 40):
        self.ps, self.block = ps, block
        self.tree = RadixCache(ps)
        self.tiers = LowerTiers(self.tree, pool, host, disk_pages, disk, page_bytes=8)
        self.mem = PagedMemory(pool, self.tree)
        self.facts = TreeFacts()
        self.replay = FactReplay(BlockEvents(ENCODINGS[encoding], block, ps, media_for("cpu")))
        self.tree.attach_observer(self.facts)
        self.facts.cleared()            # a fresh engine announces an empty cache first
        self.disk = disk
        self.publisher = publisher
        self.encoder, self.reader = FactEncoder(), FrameReader()
        self.leases: list[PrefixLease] = []
        self.waiting: list[tuple] = []  # (mark, tokens, namespace, engine blocks)

    def flush_events(self, pending: deque) -> None:
        """Publish the events since the last flush; each waiting prediction goes to
        `pending` with its place in the stream."""
        frames = self.reader.feed(self.encoder.frame(self.facts.take()))   # the pipe's trip
        batch = self.replay.batch(decode_facts(frames[0]))
        for mark, *rest in self.waiting:
            pending.append((self.published, self.replay.positions[mark], *rest))
        self.waiting.clear()
        if batch is not None:
            self.publisher.publish(batch)
            self.published += 1

    published = 0

    def run_moves(self) -> None:
        for mv in self.tiers.take_moves():
            if isinstance(mv, DemoteOrder) and mv.dst_tier == DISK:
                for key in mv.dst.tolist():
                    self.disk.write_page(key, b"kv-page!")
        self.tiers.moves_done()

    def check(self) -> None:
        self.tree.check_invariants()
        self.mem.check_conservation([lease.private_pages for lease in self.leases])


class Consumer:
    """A router's view of one replica, built only from the events it receives."""

    def __init__(self, pub: EventPublisher, encoding: str, block: int):
        self.pub, self.encoding = pub, encoding
        self.indexes = [LlmdIndex(block), DynamoIndex(block)]
        self.pending: deque[tuple[int, int, list[int], str | None, int]] = deque()
        self.checked = 0
        self.replayed = 0
        self.sub = self._connect(0)

    def _connect(self, next_seq: int) -> EventSubscriber:
        sub = EventSubscriber(self.pub.endpoint, self.pub.replay_endpoint,
                              encoding=self.encoding)
        sub.next_seq = next_seq
        return sub

    def disconnect(self) -> None:
        self.sub.close()
        self.sub = None

    def drain(self, sent: int) -> None:
        """Take every batch up to the `sent`-th (coming back first if away)."""
        if self.sub is None:
            self.sub = self._connect(self.next_seq)
        assert self.pub.wait_sent(sent, timeout_s=60)
        got = self.sub.receive(0)
        got += self.sub.catch_up()
        assert self.sub.lost == 0 and self.sub.next_seq == sent
        for r in got:
            self.replayed += r.replayed
            events = r.batch.events
            for i in range(len(events) + 1):
                self._check_at(r.seq, i)
                if i < len(events):
                    for index in self.indexes:
                        index.apply_event(events[i])
        self.next_seq = sent
        self._check_at(sent, 0)

    next_seq = 0

    def _check_at(self, seq: int, pos: int) -> None:
        """The predictions recorded at this place in the stream are due now."""
        pending = self.pending
        while pending and pending[0][:2] <= (seq, pos):
            at = pending.popleft()
            assert at[:2] == (seq, pos), "a prediction was skipped past its place"
            _, _, tokens, ns, engine_blocks = at
            for index in self.indexes:
                got = index.matched_blocks(tokens, ns)
                assert got == engine_blocks, (type(index).__name__, at, got)
            self.checked += 1


def fuzz(num_ops: int, ps: int, block: int, encoding: str, seed: int) -> dict:
    rng = random.Random(seed)
    pub = EventPublisher(LOCAL, LOCAL, buffer_batches=100_000, first_seq=0)
    disk = FakeDisk()
    rep = Replica(ps, block, encoding, pub, disk)
    con = Consumer(pub, encoding, block)
    heads = [[rng.randrange(4) for _ in range(rng.randrange(0, 3 * block + 1))]
             for _ in range(6)]
    counts = dict.fromkeys(["request", "release", "evict", "step", "flush",
                            "flush_namespace", "restart", "away"], 0)
    away_until = -1
    try:
        for op in range(num_ops):
            r = rng.random()
            if r < 0.55:
                kind = "request"
                tokens = rng.choice(heads) + [rng.randrange(4)
                                              for _ in range(rng.randrange(1, 2 * block))]
                ns = rng.choice(NAMESPACES)
                lease = PrefixLease(rep.mem, ns)
                cap = len(tokens) - 1
                m = lease.acquire(tokens, max_tokens=cap)    # a split: no event
                rep.waiting.append((rep.facts.mark(), tokens[:cap], ns,
                                    (m.matched_tokens + m.lower_tokens()) // block))
                try:
                    if m.lower and rng.random() < 0.7:
                        lease.load(m)
                    lease.grow(-(-len(tokens) // ps) - len(lease.pages))
                except OutOfPages:
                    lease.release()
                else:
                    rep.run_moves()
                    lease.extend(tokens, len(tokens))
                    if rng.random() < 0.2 and len(rep.leases) < 3:
                        rep.leases.append(lease)
                    else:
                        lease.release()
            elif r < 0.65:
                kind = "release"
                if rep.leases:
                    rep.leases.pop(rng.randrange(len(rep.leases))).release()
            elif r < 0.75:
                kind = "evict"
                rep.mem.free(rep.tree.evict(rng.randrange(1, 3 * block)))
            elif r < 0.95:
                kind = "step"
                rep.run_moves()
                rep.flush_events(con.pending)
            elif r < 0.97 and not rep.leases:
                kind = rng.choice(["flush", "flush_namespace"]) if r < 0.966 else "restart"
                rep.run_moves()
                if kind == "flush":
                    rep.mem.flush_cache()
                elif kind == "flush_namespace":
                    rep.mem.flush_namespace(rng.choice(NAMESPACES))
                else:
                    rep.check()
                    rep.flush_events(con.pending)  # the old engine's last batch
                    rep = restart(rep, ps, block, encoding, pub, disk)
            elif r < 0.972 and con.sub is not None:
                kind = "away"           # the subscriber leaves for a while
                con.disconnect()
                away_until = op + rng.randrange(100, 2000)
            else:
                continue
            counts[kind] += 1
            if op % 500 == 499 and (con.sub is not None or op >= away_until):
                rep.check()
                rep.flush_events(con.pending)
                con.drain(rep.published)
        rep.run_moves()
        rep.flush_events(con.pending)
        con.drain(rep.published)
        rep.check()
    finally:
        if con.sub is not None:
            con.sub.close()
        pub.close()
    assert not con.pending
    return dict(counts, checked=con.checked, replayed=con.replayed,
                batches=rep.published, stored_blocks=con.indexes[0].stored_blocks)


def restart(old: Replica, ps: int, block: int, encoding: str, pub: EventPublisher,
            disk: FakeDisk) -> Replica:
    """Start again from the disk tier's index (what KVPersistence rebuilds): every disk
    node whose path is all on disk comes back as a disk node, in a fresh tree whose events
    begin with AllBlocksCleared and announce what was reloaded."""
    saved, index = set(), []
    for node in old.tree.iter_nodes():
        pid = node.parent.id if node.parent.depth else None
        if node.tier == DISK and (pid is None or pid in saved):
            saved.add(node.id)
            index.append((node.id, pid, node.namespace, node.tokens, node.last_access))
    new = Replica(ps, block, encoding, pub, disk)
    new.published = old.published
    rebuilt: dict[int, object] = {}
    for nid, pid, ns, tokens, last in index:
        parent = rebuilt.get(pid) if pid is not None else None
        if pid is not None and parent is None:
            continue
        node = new.tiers.restore_disk_node(parent, tokens, ns, last)
        if node is not None:
            for key in new.tiers.local(DISK, node.pages).tolist():
                disk.write_page(key, b"kv-page!")
            rebuilt[nid] = node
    return new


# The suite runs 20k operations (CI time); scripts/fuzz_kv_events.py runs the same fuzz at
# 100k (60k + 40k with these settings) and more seeds.
CONFIGS = [(1, 4, "array", 1), (2, 8, "map", 2)]


@pytest.mark.parametrize("num_ops,ps,block,encoding,seed",
                         [(12_000, *CONFIGS[0]), (8_000, *CONFIGS[1])])
def test_router_index_predicts_engine_match(num_ops, ps, block, encoding, seed):
    got = fuzz(num_ops, ps, block, encoding, seed)
    print(got)
    assert got["checked"] == got["request"]
    for kind in ("restart", "away", "flush", "flush_namespace"):
        assert got[kind] > 0, got
    assert got["replayed"] > 0 and got["stored_blocks"] > 1000
    assert got["request"] > num_ops // 3
