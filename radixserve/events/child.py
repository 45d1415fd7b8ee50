"""The publisher process (`--kv-events-publisher process`, the default): run as
`python -m radixserve.events.child CONFIG_JSON` by process_publisher.py.

It reads the engine's tree facts from stdin (one frame per step: fact_messages.py), replays
them on its shadow tree into vLLM events (tree_facts.FactReplay, block_events.py) and sends
them on the ZeroMQ PUB, serving replays on the ROUTER (wire.py): the same code and bytes as
the thread mode, on a core of its own, so the engine's step never waits for the GIL it
holds. One thread: a poll over stdin and the ROUTER. Frames that arrived together (it fell
behind) make one batch. It waits on stdin, so each of the engine's writes wakes it once.
(A busy poll, `busy_poll_ms` > 0: looking at stdin that often while frames keep coming,
IDLE_AFTER_S, saves the engine's write the wake-up, ~12 us against ~3 us on a busy
machine, but its own ~10 wake-ups a step were placed on the engine's core and preempted
the engine's thread: +6.5 involuntary context switches a step at page 1 against +0.7
when it waits; bench_scheduler.py --kv-events steady --busy-poll-ms 1|0,
docs/benchmarks.md.) Its counters go to the engine through a StatsBlock
(stats_block.py). Its first line on stdout says where it listens (or why it cannot); its
logs go to stderr (the engine's). It ends when stdin ends: the engine closed it, or died.
It imports no torch (only the cache's token keys and path hashes).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
import time

import zmq

from radixserve.events.block_events import BlockEvents, media_for
from radixserve.events.fact_messages import FrameReader, decode_facts
from radixserve.events.schema import ENCODINGS
from radixserve.events.stats_block import StatsBlock
from radixserve.events.tree_facts import FactReplay
from radixserve.events.wire import EventWire

__all__ = ["main"]

log = logging.getLogger("radixserve.events.child")
MAX_FRAMES_PER_BATCH = 64       # frames joined into one batch (the thread mode's items)
READ_BYTES = 1 << 20
BUSY_POLL_MS = 0                # >0: while frames come, stdin looked at this often
IDLE_AFTER_S = 0.05             # then, this long without one: wait on stdin


def _hello(message: dict) -> None:
    """The first (and only) line on stdout, then stdout is closed."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
    os.close(1)


class Child:
    def __init__(self, wire: EventWire, replay: FactReplay, block: StatsBlock,
                 busy_poll_ms: float = BUSY_POLL_MS, discard: bool = False):
        self.wire, self.replay, self.block = wire, replay, block
        self.handled = 0
        self.busy_poll_ms = busy_poll_ms    # 0: always wait on stdin (one wake a frame)
        # Read the frames and drop them (bench_scheduler.py: the engine's side of the
        # cost without the child's work on the other core).
        self.discard = discard

    def publish(self, frames: list[bytes]) -> None:
        """One batch of the frames' facts, sent; a failure is logged and counted (the
        engine then sends a snapshot: stream.py)."""
        if self.discard:
            self.handled += len(frames)
            self.report()
            return
        try:
            facts = [fact for frame in frames for fact in decode_facts(frame)]
            batch = self.replay.batch(facts)
            if batch is not None:
                self.wire.send(batch)
        except Exception:
            log.exception("kv-events: publishing a batch failed")
            self.wire.stats.failed_batches += 1
        self.handled += len(frames)
        self.report()

    def report(self) -> None:
        s = self.wire.stats
        self.block.write((self.handled, s.published_batches, s.published_bytes,
                          s.replay_requests, s.bad_replay_requests, s.failed_batches,
                          time.process_time(),
                          resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw))

    def run(self, fd: int = 0) -> None:
        idle, busy = zmq.Poller(), zmq.Poller()     # busy: the ROUTER only
        idle.register(fd, zmq.POLLIN)
        if self.wire.replay is not None:
            idle.register(self.wire.replay, zmq.POLLIN)
            busy.register(self.wire.replay, zmq.POLLIN)
        os.set_blocking(fd, False)
        reader = FrameReader()
        read_bytes, last_frame = 0, 0.0
        poll_ms = self.busy_poll_ms
        idle_after_s = IDLE_AFTER_S if poll_ms else 0.0
        while True:
            is_busy = time.monotonic() - last_frame < idle_after_s
            if not is_busy:
                ready = dict(idle.poll())
            elif self.wire.replay is not None:
                ready = dict(busy.poll(poll_ms))
            else:                   # an empty poller returns at once: sleep instead
                time.sleep(poll_ms / 1e3)
                ready = {}
            if self.wire.replay in ready:
                self.wire.serve_replays()
                self.report()
            if not is_busy and fd not in ready:
                continue
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:
                continue
            last_frame = time.monotonic()
            read_bytes += len(data)
            self.block.set_read_bytes(read_bytes)
            frames = reader.feed(data)
            for i in range(0, len(frames), MAX_FRAMES_PER_BATCH):
                self.publish(frames[i:i + MAX_FRAMES_PER_BATCH])
            if not data:
                if reader.partial:
                    log.warning("kv-events: the engine's pipe ended inside a frame "
                                "(%d bytes dropped)", reader.partial)
                return


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the engine decides when it ends
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = json.loads(argv[1])
    block = StatsBlock(config["stats_fd"], create=False)
    try:
        replay = FactReplay(BlockEvents(ENCODINGS[config["encoding"]], config["block_size"],
                                        config["page_size"], media_for(config["pool_device"]),
                                        config["rank"]))
        wire = EventWire(config["endpoint"], config["replay_endpoint"], config["topic"],
                         config["buffer_batches"], first_seq=config["first_seq"])
    except Exception as exc:
        _hello({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _hello({"endpoint": wire.endpoint, "replay_endpoint": wire.replay_endpoint,
            "first_seq": wire.first_seq, "torch_loaded": "torch" in sys.modules})
    child = Child(wire, replay, block, config.get("busy_poll_ms", BUSY_POLL_MS),
                  config.get("discard", False))
    child.report()
    try:
        child.run()
    finally:
        wire.close()
        block.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
