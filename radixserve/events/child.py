"""The publisher process (`--kv-events-publisher process`, the default): run as
`python -m radixserve.events.child CONFIG_JSON` by process_publisher.py.

It takes the engine's tree facts from a ring in shared memory (one frame per hand-over:
fact_messages.py, frame_ring.py), replays them on its shadow tree into vLLM events
(tree_facts.FactReplay, block_events.py) and sends them on the ZeroMQ PUB, serving
replays on the ROUTER (wire.py): the same code and bytes as the thread mode, on a core of
its own, so the engine's step never waits for the GIL it holds. One thread: a poll over
stdin and the ROUTER. Frames that arrived together make one batch.

While frames come it drains the ring every `drain_ms` (the engine's hand-over interval:
about one wake a frame, as when it waited on a pipe, but the engine's thread no longer
pays a pipe write for it). After IDLE_AFTER_S without a frame it says it sleeps
(FrameRing.set_sleeping) and waits on stdin, where the engine's next put rings a byte
(with a backstop timeout as well: frame_ring.py). The engine
also rings when it goes idle (stream.py: its last facts should not wait for a drain, so
a router sees a finished request's blocks at once). A 1 ms poll
was tried once: its ~10 wake-ups a step were placed on the engine's core and preempted the
engine's thread (+6.5 involuntary context switches a step at page 1), hence a drain at
the hand-over's own pace. Its counters go to the engine through a StatsBlock
(stats_block.py). Its first line on stdout says where it listens (or why it cannot); its
logs go to stderr (the engine's). It ends when stdin ends (the engine closed it, or
died), after a last drain of the ring. It imports no torch (only the cache's token keys
and path hashes).
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
from radixserve.events.frame_ring import FrameRing
from radixserve.events.schema import ENCODINGS
from radixserve.events.stats_block import StatsBlock
from radixserve.events.tree_facts import FactReplay
from radixserve.events.wire import EventWire

__all__ = ["main"]

log = logging.getLogger("radixserve.events.child")
MAX_FRAMES_PER_BATCH = 64       # frames joined into one batch (the thread mode's items)
DRAIN_MS = 10                   # while frames come, the ring is drained this often
IDLE_AFTER_S = 0.1              # then, this long without one: sleep until the doorbell
BACKSTOP_MS = 100               # a sleep's longest (a doorbell both sides missed)


def _hello(message: dict) -> None:
    """The first (and only) line on stdout, then stdout is closed."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
    os.close(1)


class Child:
    def __init__(self, wire: EventWire, replay: FactReplay, block: StatsBlock,
                 ring: FrameRing, drain_ms: float = DRAIN_MS, discard: bool = False):
        self.wire, self.replay, self.block, self.ring = wire, replay, block, ring
        self.handled = 0
        self.drain_ms = max(round(drain_ms), 1)     # zmq polls in whole ms
        # Take the frames and drop them (bench_scheduler.py: the engine's side of the
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
        poller = zmq.Poller()
        poller.register(fd, zmq.POLLIN)         # the doorbell, and the engine's end
        if self.wire.replay is not None:
            poller.register(self.wire.replay, zmq.POLLIN)
        os.set_blocking(fd, False)
        reader = FrameReader()
        last_frame = time.monotonic()
        asleep = False
        while True:
            if asleep:
                timeout = BACKSTOP_MS
            elif time.monotonic() - last_frame >= IDLE_AFTER_S:
                asleep = True
                self.ring.set_sleeping(True)    # set until a frame comes
                # A frame put before the engine could see the flag is taken now.
                timeout = 0 if self.ring.pending() else BACKSTOP_MS
            else:
                timeout = self.drain_ms
            ready = dict(poller.poll(timeout))
            if self.wire.replay in ready:
                self.wire.serve_replays()
                self.report()
            ended = False
            if fd in ready:
                try:
                    ended = not os.read(fd, 4096)       # doorbells carry nothing
                except BlockingIOError:
                    pass
            data = self.ring.take()
            if data:
                last_frame = time.monotonic()
                if asleep:
                    asleep = False
                    self.ring.set_sleeping(False)
                frames = reader.feed(data)
                for i in range(0, len(frames), MAX_FRAMES_PER_BATCH):
                    self.publish(frames[i:i + MAX_FRAMES_PER_BATCH])
            if ended:
                if reader.partial:
                    log.warning("kv-events: the engine ended inside a frame (%d bytes "
                                "dropped)", reader.partial)
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
    ring = FrameRing(config["ring_fd"], config["ring_bytes"], create=False)
    child = Child(wire, replay, block, ring, config.get("drain_ms", DRAIN_MS),
                  config.get("discard", False))
    child.report()
    try:
        child.run()
    finally:
        wire.close()
        block.close()
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
