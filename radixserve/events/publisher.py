"""EventPublisher: KV event batches out on ZeroMQ, off the scheduler's thread.

The contract is vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py):
- a PUB socket sends each batch as (topic, 8-byte big-endian sequence number, msgpack
  payload); the endpoint is bound when it has a wildcard (`tcp://*:5557`, also
  `tcp://127.0.0.1:*` for a free port) or is ipc/inproc, else connected to;
- an optional ROUTER socket answers replay requests: a client sends (empty frame, start
  sequence number as 8 big-endian bytes) and gets every buffered (seq, payload) from there,
  then (END_SEQ, b""). One departure, so a subscriber knows it must resync: a start older
  than the oldest buffered batch gets the end marker alone (vLLM sends what it still has),
  unless the buffer still holds the stream's first batch: then the whole stream is there
  (the engine's first batch is an AllBlocksCleared: stream.py). A malformed request is
  logged and ignored.

Sequence numbers never go back, across restarts too: a stream starts at the microseconds
since the Unix epoch (`first_seq`), above any number an earlier publisher on the same
endpoint sent (that would take more than a batch a microsecond). vLLM starts at 0, and a
consumer connected across a restart then waits for numbers it has passed: Dynamo's
listener (ai-dynamo-runtime 1.6.1) drops every batch below the next one it expects. Here
it sees a gap instead, asks for a replay and gets the new stream from its start.

The engine's step only appends an item to a bounded queue (`publish`); a thread turns it
into a batch (`prepare`: the engine queues its tree's raw changes and the thread computes
the events, events/tree_facts.py), encodes and sends it; items queued while it was busy
join into one batch (one encode, one send). When the queue is full (no thread
progress: a stuck send, a busy machine) the oldest item is dropped and counted
(`dropped_batches`, in /metrics) and `publish` says so, so that a producer whose items
depend on each other can put one self-contained item in place of the queue
(`replace_queued`). A slow or absent subscriber never blocks the engine (PUB itself drops
at its high-water mark).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from radixserve.events.schema import END_SEQ

__all__ = ["EventPublisher", "PublisherStats", "offset_endpoint_port"]

log = logging.getLogger(__name__)
_END = END_SEQ.to_bytes(8, "big", signed=True)
_STOP = object()                # queued by close: the thread ends after what came before


def offset_endpoint_port(endpoint: str | None, offset: int) -> str | None:
    """`tcp://host:5557` with the port moved by `offset` (one endpoint per replica, as vLLM
    does per data-parallel rank); ipc/inproc endpoints get a suffix."""
    if not endpoint or offset == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_{offset}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot offset the port of {endpoint!r}: give a numeric port")
    return f"{base}:{int(port) + offset}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind stable (wildcard) endpoints, connect to the others."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def open_socket(ctx: zmq.Context, kind: int, endpoint: str, **options) -> tuple:
    """A socket of `kind` with no linger (and `options`, e.g. SNDHWM=0), bound to or
    connected to `endpoint` by vLLM's rule; returns it with the endpoint it really has
    (a bound wildcard port resolved)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    if _binds(endpoint):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint


@dataclass
class PublisherStats:
    published_batches: int = 0
    dropped_batches: int = 0
    published_bytes: int = 0
    replay_requests: int = 0
    bad_replay_requests: int = 0
    # The publisher thread's own CPU seconds so far (time.thread_time() read in it after
    # each batch): what publishing costs beside the engine's step (bench_scheduler.py).
    thread_cpu_s: float = 0.0


class EventPublisher:
    """Publishes KVEventBatch structs on `endpoint` (and serves replays on
    `replay_endpoint`) from its own thread; `publish` never blocks. With `prepare`, the
    queued items are whatever it turns into a batch (or None: nothing to send) on the
    thread: it gets a list of them, every item queued when the thread woke (up to
    MAX_ITEMS_PER_BATCH), in order, and makes one batch of them all."""

    IDLE_WAIT_S = 0.05          # the thread's wake-up period for replay requests when idle
    MAX_ITEMS_PER_BATCH = 64    # queued items (with `prepare`) joined into one batch

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 max_queue_batches: int = 4096, buffer_batches: int = 10_000,
                 hwm: int = 100_000, context: zmq.Context | None = None,
                 prepare: Callable[[list], object | None] | None = None,
                 first_seq: int | None = None):
        self._ctx = context or zmq.Context.instance()
        self._pub, self.endpoint = open_socket(self._ctx, zmq.PUB, endpoint, SNDHWM=hwm)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            # Always bound. No high-water mark: a ROUTER silently drops what passes it,
            # and a replay is at most the buffer (vLLM keeps the default 1,000 and loses
            # longer replays).
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self._topic = topic.encode()
        self.stats = PublisherStats()
        # SimpleQueue: put and the thread's wake-up are one C call each (a Condition
        # costs the producer ~10 us a batch in Python code).
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._max_queue = max_queue_batches
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._sent = threading.Condition()
        self._accepted = 0          # items given to publish, dropped ones included
        self._handled = 0           # items the thread sent, found empty or failed on
        self._prepare = prepare
        self.resync_wanted = False  # an item failed: the producer should replace_queued
        # the first sequence number (default: now in microseconds since the epoch)
        self.first_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._seq = self.first_seq
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    # publish, replace_queued and close are called from one thread (the engine's).
    def publish(self, batch) -> bool:
        """Queue one KVEventBatch (or item for `prepare`). Never blocks: a full queue drops
        its oldest item, and then this returns False."""
        full = self._queue.qsize() >= self._max_queue
        if full:
            self._drop(1)
        self._queue.put(batch)
        self._accepted += 1
        return not full

    def replace_queued(self, item) -> None:
        """Drop every queued item (counted) and queue `item` alone (a producer's
        self-contained restart after `publish` returned False or `resync_wanted`)."""
        self.resync_wanted = False
        self._drop(self._queue.qsize())
        self._queue.put(item)
        self._accepted += 1

    def _drop(self, n: int) -> None:
        """Take up to `n` of the oldest queued items out, counted as dropped."""
        dropped = 0
        for _ in range(n):
            try:
                self._queue.get_nowait()
            except queue.Empty:         # the thread took them meanwhile
                break
            dropped += 1
        with self._sent:
            self.stats.dropped_batches += dropped
            self._sent.notify_all()

    def queued(self) -> int:
        return self._queue.qsize()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every item published so far was handled or dropped (False at the
        timeout)."""
        with self._sent:
            return self._sent.wait_for(
                lambda: self._handled + self.stats.dropped_batches >= self._accepted,
                timeout_s)

    def sent_when_idle(self, timeout_s: float = 30) -> int:
        """The batches sent in all once every item published so far was handled (the
        sequence number after the last, less `first_seq`); TimeoutError if the thread is
        stuck."""
        if not self.wait_idle(timeout_s):
            raise TimeoutError("the kv-events thread did not finish its queue in time")
        return self.stats.published_batches

    def wait_sent(self, num_batches: int, timeout_s: float) -> bool:
        """Block until `num_batches` batches in all were sent (False at the timeout)."""
        with self._sent:
            return self._sent.wait_for(
                lambda: self.stats.published_batches >= num_batches, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), then stop the thread and the sockets."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as exc:
                    log.warning("kv-events replay socket: %s", exc)
            try:
                item = self._queue.get(timeout=self.IDLE_WAIT_S)
            except queue.Empty:
                continue
            items, stop = self._take_more([item])
            if items:
                try:
                    batch = items[0] if self._prepare is None else self._prepare(items)
                    if batch is not None:
                        self._send(batch)
                except Exception:           # never let one batch stop the thread
                    log.exception("kv-events: publishing a batch failed")
                    self.resync_wanted = True
                with self._sent:
                    self._handled += len(items)
                    self.stats.thread_cpu_s = time.thread_time()
                    self._sent.notify_all()
            if stop:
                return

    def _take_more(self, items: list) -> tuple[list, bool]:
        """With `prepare`, every item queued behind the first (up to MAX_ITEMS_PER_BATCH)
        joins it: a thread that fell behind (a busy machine, the engine's thread holding
        the GIL) catches up with one batch, one encode and one send. Returns the items
        and whether close's stop came."""
        if items[0] is _STOP:
            return [], True
        if self._prepare is None:
            return items, False
        while len(items) < self.MAX_ITEMS_PER_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                return items, True
            items.append(item)
        return items, False

    def _send(self, batch) -> None:
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        with self._sent:            # _run notifies the waiters once the item is done
            self.stats.published_batches += 1
            self.stats.published_bytes += len(payload)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        self.stats.replay_requests += 1
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.stats.bad_replay_requests += 1
            log.warning("kv-events: ignored a malformed replay request (%d frames: %s)",
                        len(frames), [f[:16] for f in frames[1:]])
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big", signed=True)
        buffered = list(self._buffer)
        whole = buffered and buffered[0][0] == self.first_seq    # the stream from its start
        if start >= 0 and (not buffered or whole or start >= buffered[0][0]):
            for seq, payload in buffered:
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END, b""))
