"""KVEvents: one engine's KV events, from its radix tree to the wire.

Ties the tree observer (block_events.py) to the publisher (publisher.py): the observer
gathers the step's events on the engine's thread, `flush` hands them over as one batch
(the engine calls it after each step and after admin changes such as a flush or a
restore), and the publisher's thread does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.radix_cache import RadixCache
from radixserve.events.block_events import BlockEvents, media_for
from radixserve.events.publisher import EventPublisher, PublisherStats, offset_endpoint_port
from radixserve.events.schema import ENCODINGS

__all__ = ["KVEvents", "KVEventsConfig"]


@dataclass(frozen=True)
class KVEventsConfig:
    """The --kv-events flags (docs/configuration.md)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 16
    encoding: str = "array"

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-encoding must be one of {sorted(ENCODINGS)}, "
                             f"got {self.encoding!r}")

    @classmethod
    def from_engine(cls, config) -> KVEventsConfig | None:
        """The flags of an EngineConfig (None: --kv-events not given)."""
        if not config.kv_events:
            return None
        return cls(config.kv_events, config.kv_events_replay, config.kv_events_topic,
                   config.kv_events_block_size, config.kv_events_encoding)

    def for_replica(self, index: int) -> KVEventsConfig:
        """Replica `index`'s own endpoints (ports moved by `index`, as vLLM does per
        data-parallel rank); the topic is kept, so consumers key replicas by endpoint."""
        return KVEventsConfig(offset_endpoint_port(self.endpoint, index),
                              offset_endpoint_port(self.replay_endpoint, index),
                              self.topic, self.block_size, self.encoding)


class KVEvents:
    """The tree's observer and the publisher of one engine."""

    def __init__(self, tree: RadixCache, config: KVEventsConfig, pool_device: str,
                 rank: int = 0):
        self.config = config
        self.blocks = BlockEvents(ENCODINGS[config.encoding], config.block_size,
                                  tree.page_size, media_for(pool_device), rank)
        self.publisher = EventPublisher(config.endpoint, config.replay_endpoint, config.topic)
        tree.attach_observer(self.blocks)
        self.blocks.cleared()       # a fresh engine holds nothing: consumers start over
        self.flush()

    def flush(self) -> None:
        """Queue the events gathered since the last flush as one batch (none: nothing)."""
        batch = self.blocks.take_batch()
        if batch is not None:
            self.publisher.publish(batch)

    @property
    def stats(self) -> PublisherStats:
        return self.publisher.stats

    def close(self) -> None:
        self.flush()
        self.publisher.close()
