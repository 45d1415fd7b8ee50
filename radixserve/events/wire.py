"""EventWire: the ZeroMQ side of a KV events publisher, vLLM's ZmqEventPublisher contract
(vllm/distributed/kv_events.py), used alike by the publisher thread (publisher.py) and
the publisher process (child.py), so both send the same bytes:
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

Not thread-safe: one thread sends and serves replays.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from radixserve.events.schema import END_SEQ

__all__ = ["EventWire", "PublisherStats", "open_socket"]

log = logging.getLogger("radixserve.events.publisher")
_END = END_SEQ.to_bytes(8, "big", signed=True)


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
    # The publisher's own CPU seconds so far: its thread's (time.thread_time() read in it
    # after each batch) or its process's (--kv-events-publisher process): what publishing
    # costs beside the engine's step (bench_scheduler.py).
    cpu_s: float = 0.0
    # Batches whose events could not be computed (a resync follows: stream.py).
    failed_batches: int = 0
    # The publisher process ended while the engine still ran (logged; restarted, up to a
    # bound: process_publisher.py).
    publisher_exits: int = 0
    # The publisher process restarted after it ended (its first batch: a snapshot).
    publisher_restarts: int = 0


class EventWire:
    """The PUB socket (and ROUTER for replays) of one stream, its sequence numbers and the
    replay buffer of the last `buffer_batches` payloads; counts into `stats`."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, hwm: int = 100_000,
                 context: zmq.Context | None = None, first_seq: int | None = None,
                 stats: PublisherStats | None = None):
        self._ctx = context or zmq.Context.instance()
        self._pub, self.endpoint = open_socket(self._ctx, zmq.PUB, endpoint, SNDHWM=hwm)
        self.replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            # Always bound. No high-water mark: a ROUTER silently drops what passes it,
            # and a replay is at most the buffer (vLLM keeps the default 1,000 and loses
            # longer replays).
            try:
                self.replay = self._ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.setsockopt(zmq.SNDHWM, 0)
                self.replay.bind(replay_endpoint)
            except zmq.ZMQError:
                self.close()
                raise
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self._topic = topic.encode()
        self.stats = stats or PublisherStats()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        # the first sequence number (default: now in microseconds since the epoch)
        self.first_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._seq = self.first_seq
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, batch) -> None:
        """Encode one KVEventBatch, send it with the next sequence number and buffer it."""
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.stats.published_batches += 1
        self.stats.published_bytes += len(payload)

    def serve_replays(self) -> None:
        """Answer every replay request waiting on the ROUTER (none: nothing)."""
        if self.replay is None:
            return
        try:
            while self.replay.poll(0):
                self._serve_replay()
        except zmq.ZMQError as exc:
            log.warning("kv-events replay socket: %s", exc)

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
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
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", _END, b""))

    def close(self) -> None:
        for sock in (self._pub, self.replay):
            if sock is not None:
                sock.close(linger=0)
