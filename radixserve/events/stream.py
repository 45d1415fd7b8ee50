"""KVEvents: one engine's KV events, from its radix tree to the wire.

Ties the tree to the publisher: on the engine's thread the tree's observer only records
its changes as raw facts (tree_facts.py); `flush` hands the step's facts to the
publisher's queue (the engine calls it after each step and after admin changes such as a
flush or a restore), and the publisher turns them (with any other steps' facts queued
meanwhile, when it fell behind) into one batch of events (tree_facts.FactReplay,
block_events.py), encodes and sends it. The publisher is a process of its own by default
(`--kv-events-publisher process`: process_publisher.py, child.py; the flush then also
encodes the facts as one message and copies it into the child's ring) or a thread of the
engine's (`thread`: publisher.py);
both run the same replay and wire code, so they send the same events. If the queue ever
overflows (a stuck thread), or a batch fails, or the publisher process died and was
restarted, dropped facts would leave the events wrong for good, so the queue is replaced
by a snapshot of the whole tree: consumers get AllBlocksCleared and then every block held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.cache.radix_cache import RadixCache
from radixserve.events.block_events import BlockEvents, media_for
from radixserve.events.process_publisher import ProcessPublisher
from radixserve.events.publisher import EventPublisher, PublisherStats
from radixserve.events.schema import ENCODINGS
from radixserve.events.tree_facts import FactReplay, TreeFacts, snapshot

PUBLISHERS = ("process", "thread")

__all__ = ["KVEvents", "KVEventsConfig"]


@dataclass(frozen=True)
class KVEventsConfig:
    """The --kv-events flags (docs/configuration.md)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 16
    encoding: str = "array"
    publisher: str = "process"      # process | thread (stream.py)
    interval_s: float = 0.010       # after_step hands facts over at most this often

    def __post_init__(self):
        if self.interval_s < 0:
            raise ValueError(f"--kv-events-interval-ms must be >= 0, got "
                             f"{self.interval_s * 1e3:g}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-encoding must be one of {sorted(ENCODINGS)}, "
                             f"got {self.encoding!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"--kv-events-publisher must be one of {list(PUBLISHERS)}, "
                             f"got {self.publisher!r}")

    @classmethod
    def from_engine(cls, config) -> KVEventsConfig | None:
        """The flags of an EngineConfig (None: --kv-events not given)."""
        if not config.kv_events:
            return None
        return cls(config.kv_events, config.kv_events_replay, config.kv_events_topic,
                   config.kv_events_block_size, config.kv_events_encoding,
                   config.kv_events_publisher, config.kv_events_interval_ms / 1e3)


class KVEvents:
    """The tree's observer and the publisher of one engine. `child_options`: more keys
    for the publisher process (child.py: drain_ms, discard), for bench_scheduler.py;
    `clock`: for tests of `after_step`."""

    def __init__(self, tree: RadixCache, config: KVEventsConfig, pool_device: str,
                 rank: int = 0, queue_batches: int = 4096, ring_bytes: int = 1 << 20,
                 child_options: dict | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.tree = tree
        self._clock = clock
        self._flushed_at = clock()
        # (checks the block size here, whichever mode)
        blocks = BlockEvents(ENCODINGS[config.encoding], config.block_size,
                             tree.page_size, media_for(pool_device), rank)
        self.facts = TreeFacts()
        self.replay: FactReplay | None = None   # thread mode: used on its thread only
        self.publisher: ProcessPublisher | EventPublisher
        if config.publisher == "process":
            self.publisher = ProcessPublisher(
                {"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
                 "topic": config.topic, "encoding": config.encoding,
                 "block_size": config.block_size, "page_size": tree.page_size,
                 "pool_device": pool_device, "rank": rank, "first_seq": None,
                 "buffer_batches": 10_000,
                 # it drains the ring at the hand-over's pace (5 ms at the most often)
                 "drain_ms": max(config.interval_s * 1e3, 5.0), **(child_options or {})},
                max_queue_batches=queue_batches,
                ring_bytes=ring_bytes)
        else:
            self.replay = FactReplay(blocks)
            self.publisher = EventPublisher(config.endpoint, config.replay_endpoint,
                                            config.topic, max_queue_batches=queue_batches,
                                            prepare=self._batch)
        tree.attach_observer(self.facts)
        self.facts.cleared()        # a fresh engine holds nothing: consumers start over
        self.flush()

    def _batch(self, items: list[list[tuple]]):
        """(On the publisher's thread.) One batch of every queued step's facts."""
        facts = items[0] if len(items) == 1 else [fact for step in items for fact in step]
        return self.replay.batch(facts)

    def after_step(self) -> None:
        """(The engine, after each step.) `flush` once `interval_s` has passed since the
        last one, so a busy engine pays the hand-over (an encode and a copy into the
        child's ring; the thread mode's lock and wake-up) once per interval, not
        once per step: at 256 running with a 4 ms scheduling step that cut the events'
        instructions on the step by an eighth (docs/benchmarks.md). Consumers see the same
        events, in fewer batches, at most one interval and one step later; the engine
        flushes at once when it goes idle."""
        now = self._clock()
        if now - self._flushed_at >= self.config.interval_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Queue the facts gathered since the last flush (none: nothing), for one batch;
        or the snapshot, after a failure on the thread or a full queue. Called by the
        engine (`now` None: it went idle, or an admin change), the publisher process is
        woken at once; called by `after_step`, it drains at its own pace (child.py)."""
        self._flushed_at = self._clock() if now is None else now
        facts = self.facts.take()
        if self.publisher.resync_wanted:
            self.publisher.replace_queued(snapshot(self.tree))
        elif facts and not self.publisher.publish(facts, wake=now is None):
            self.publisher.replace_queued(snapshot(self.tree))

    @property
    def stats(self) -> PublisherStats:
        return self.publisher.stats

    def close(self) -> None:
        self.flush()
        self.publisher.close()
