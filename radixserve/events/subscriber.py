"""EventSubscriber: the consumer side of the KV events contract, for tools and tests.

Subscribes to a publisher's PUB endpoint and decodes batches with the schema's structs;
with a replay endpoint it fills gaps the way vLLM's protocol allows: on a sequence number
past the next expected one (a subscriber that joined late or was away) it asks the ROUTER
for everything from the first missing number and takes the replayed batches up to the end
marker. A replay that cannot fill the gap (the publisher no longer buffers it) sets
`lost`: the consumer's index may be stale and must be rebuilt (`radixserve kv-events`
says so; the cluster's event view forgets the replica). A gap the replay fills with a
stream that starts with AllBlocksCleared is a publisher that restarted (its numbers
continue above the old ones, publisher.py): nothing is lost, the clear resets the index
(`restarts` counts them). A new subscriber takes the stream from its first buffered
batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from radixserve.events.wire import open_socket
from radixserve.events.schema import END_SEQ, ENCODINGS

__all__ = ["EventSubscriber", "Received"]

log = logging.getLogger(__name__)


@dataclass
class Received:
    """One batch: its sequence number, decoded batch, payload size, and whether it came
    through a replay."""

    seq: int
    batch: object
    nbytes: int
    replayed: bool = False


@dataclass
class _Gap:
    first_missing: int
    seen: list = field(default_factory=list)


class EventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 encoding: str = "array", context: zmq.Context | None = None,
                 replay_timeout_ms: int = 5000, decode=None):
        self._ctx = context or zmq.Context.instance()
        self.sub, self.endpoint = open_socket(self._ctx, zmq.SUB, endpoint,
                                              SUBSCRIBE=topic.encode())
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_ms = replay_timeout_ms
        # `decode`: payload -> batch (default: this package's structs for `encoding`)
        self._decode = decode or ENCODINGS[encoding].decoder().decode
        self.next_seq: int | None = None    # the first number not taken yet (None: any)
        self.lost = 0               # batches a replay could not give back
        self.restarts = 0           # jumps to a new stream that starts with a clear

    def close(self) -> None:
        self.sub.close(linger=0)

    def replay(self, start: int) -> list[Received] | None:
        """Every buffered batch from `start` (None: no replay endpoint). Waits for the
        end marker up to `replay_timeout_ms` (TimeoutError)."""
        if not self.replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)      # a long replay must not be cut
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            got = []
            while True:
                if not sock.poll(self.replay_timeout_ms):
                    raise TimeoutError(f"no end marker from {self.replay_endpoint}")
                _, seq_b, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append(Received(seq, self._decode(payload), len(payload), True))
        finally:
            sock.close(linger=0)

    def catch_up(self) -> list[Received]:
        """Replay from `next_seq` (a subscriber that starts late or comes back)."""
        got = self.replay(self.next_seq or 0) or []
        return self._take(got)

    def receive(self, timeout_ms: int) -> list[Received]:
        """The batches that arrive within `timeout_ms` (at least one, or none at the
        timeout), in order, gaps filled by replay where possible."""
        out: list[Received] = []
        if not self.sub.poll(timeout_ms):
            return out
        while self.sub.poll(0):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.next_seq is not None and seq < self.next_seq:
                continue                # taken already (through a replay)
            if self.next_seq is None or seq > self.next_seq:
                replayed = self.replay(self.next_seq or 0)
                if replayed is not None:
                    if self.next_seq is None and not replayed:
                        self.lost += 1      # the stream's start is no longer buffered
                        log.warning("kv-events: joined at seq %d, the stream's start is "
                                    "no longer buffered: resync", seq)
                    out.extend(self._take([r for r in replayed if r.seq < seq]))
            out.extend(self._take([Received(seq, self._decode(payload),
                                            len(payload))]))
        return out

    def _take(self, got: list[Received]) -> list[Received]:
        """The batches that continue the sequence, in order; advances `next_seq`. A jump
        is a restart when the batch starts with AllBlocksCleared, else `lost`."""
        out = []
        for r in got:
            expected = self.next_seq
            if expected is not None and r.seq < expected:
                continue
            if expected is not None and r.seq > expected:
                events = getattr(r.batch, "events", None)
                if events and type(events[0]).__name__ == "AllBlocksCleared":
                    self.restarts += 1
                else:
                    self.lost += r.seq - expected
                    log.warning("kv-events: %d batches lost before seq %d: resync",
                                r.seq - expected, r.seq)
            out.append(r)
            self.next_seq = r.seq + 1
        return out
