"""Faults: a stuck or absent subscriber never blocks the producer (the bounded queue drops
its oldest batch and counts it), a replay from a sequence no longer buffered gets the end
marker alone, and a malformed replay request is ignored and logged; replicas on one host
get endpoints of their own."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from radixserve.events.publisher import EventPublisher, offset_endpoint_port
from radixserve.events.schema import ENCODINGS
from radixserve.events.subscriber import EventSubscriber
from radixserve.server.metrics import kv_events_metrics
from tests.events.conftest import LOCAL, drain

C = ENCODINGS["array"]


def batch(i: int):
    return C.KVEventBatch(ts=float(i), events=[C.BlockRemoved(block_hashes=[i], medium="CPU")])


def test_full_queue_drops_the_oldest_and_never_blocks():
    pub = EventPublisher(LOCAL, LOCAL, max_queue_batches=8)
    stuck, inside = threading.Event(), threading.Event()
    real_send = pub._send

    def stuck_send(b):              # the socket hangs (a blocked send) until released
        inside.set()
        stuck.wait()
        real_send(b)

    pub._send = stuck_send
    try:
        pub.publish(batch(0))
        assert inside.wait(10)      # the thread holds batch 0 and hangs
        for i in range(1, 101):     # returns at once every time (else the test hangs)
            pub.publish(batch(i))
        assert pub.stats.dropped_batches == 100 - 8 and pub.queued() == 8
        stuck.set()
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        got = drain(sub, pub, 9)
        sub.close()
        # Batch 0, then the newest 8: the oldest queued ones were dropped.
        assert [r.batch.ts for r in got] == [0.0] + [float(i) for i in range(93, 101)]
        names = {m.name: m.samples[0].value for m in kv_events_metrics(pub.stats)}
        assert names["radixserve_kv_events_dropped_batches"] == 92
    finally:
        stuck.set()
        pub.close()


def test_absent_subscriber_does_not_block():
    # A connect endpoint nobody listens on: PUB queues up to its high-water mark, then drops.
    ctx = zmq.Context.instance()
    probe = ctx.socket(zmq.REP)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    pub = EventPublisher(f"tcp://127.0.0.1:{port}", hwm=16)
    try:
        for i in range(2000):
            pub.publish(batch(i))
        assert pub.wait_sent(2000, timeout_s=60)
        assert pub.stats.dropped_batches == 0     # every send returned: nothing waited
        assert pub.wait_idle(timeout_s=60)
        # The thread's own CPU (bench_scheduler's publisher share), read inside it: some
        # was spent, and no more than the whole process's.
        assert 0 < pub.stats.cpu_s <= time.process_time()
    finally:
        pub.close()


def test_replay_of_a_lost_sequence_gets_the_end_marker_alone():
    pub = EventPublisher(LOCAL, LOCAL, buffer_batches=4, first_seq=0)
    try:
        for i in range(10):
            pub.publish(batch(i))
        assert pub.wait_sent(10, timeout_s=30)
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        sub.next_seq = 2
        assert sub.replay(2) == []                          # gone: resync
        assert [r.seq for r in sub.replay(6)] == [6, 7, 8, 9]
        assert sub.catch_up() == [] and sub.next_seq == 2   # nothing continues seq 2
        sub.close()
    finally:
        pub.close()


def test_bad_replay_requests_are_ignored_and_logged(caplog):
    pub = EventPublisher(LOCAL, LOCAL, first_seq=0)
    ctx = zmq.Context.instance()
    try:
        pub.publish(batch(0))
        assert pub.wait_sent(1, timeout_s=30)
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(pub.replay_endpoint)
        with caplog.at_level(logging.WARNING, logger="radixserve.events.publisher"):
            bad.send_multipart([b"", b"not-a-number!"])         # 13 bytes, not 8
            bad.send_multipart([b"", b"\x00" * 8, b"extra"])    # a frame too many
            bad.send(b"\x00" * 8)                               # no empty delimiter
            # Then a good one from the same client: one peer's requests are served in
            # order, so its answer comes after the three were handled.
            bad.send_multipart([b"", (0).to_bytes(8, "big")])
            replies = [bad.recv_multipart() for _ in range(2)]
        assert [r[1] for r in replies] == [(0).to_bytes(8, "big"), (-1).to_bytes(8, "big", signed=True)]
        bad.close(linger=0)
        assert pub.stats.bad_replay_requests == 3
        assert sum("malformed replay request" in r.message for r in caplog.records) == 3
        pub.publish(batch(1))               # and it keeps publishing
        assert pub.wait_sent(2, timeout_s=30)
    finally:
        pub.close()


def test_each_replica_gets_its_own_endpoints():
    # cluster/replica.py moves a --kv-events port by the replica's Serve rank (as vLLM does
    # per data-parallel rank); a free port ("*") is left to each replica's own bind.
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.2:5558", 1) == "tcp://10.0.0.2:5559"
    assert offset_endpoint_port("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError, match="numeric port"):
        offset_endpoint_port("tcp://host:events", 1)
