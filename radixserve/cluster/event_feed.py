"""The router's view of replicas from their KV events instead of their digests.

With `--router-view events` every replica publishes its KV events (radixserve/events) on
an endpoint of its own and advertises it in its routing stats (`kv_event_metadata`, the
shape Ray Serve LLM's KV-aware router reads). The front end subscribes to each one here,
on one thread, and keeps each replica's held blocks from the events alone: a block is held
while some medium holds it. Its block hashes are the path hashes the digests carry (the
events' block size is the router's block size), so the router's policy is unchanged: the
feed hands `ClusterState` a fresh `CacheDigest` of the held set after each round of
batches, stamped with the newest batch's time on the replica (`taken_at`), so requests
routed before it are bridged exactly as with digests.

`lag_seconds` keeps, per batch, how long after the replica made it the view had it:
the view lag (digests: up to one routing-stats period plus the walk).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from radixserve.events.subscriber import EventSubscriber

from .cache_digest import CacheDigest
from .view import ClusterState

__all__ = ["EventFeed"]

log = logging.getLogger("radixserve.cluster")


class _ReplicaBlocks:
    """One replica's subscription and the media holding each block."""

    def __init__(self, sub: EventSubscriber, block_tokens: int):
        self.sub = sub
        self.block_tokens = block_tokens
        self.media: dict[int, set[str | None]] = {}
        self.version = 0
        self.caught_up = False      # the replay from sequence 0 was asked once

    def apply(self, batch) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                for h in ev.block_hashes:
                    self.media.setdefault(h, set()).add(ev.medium)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    held = self.media.get(h)
                    if held is not None:
                        held.discard(ev.medium)
                        if not held:
                            del self.media[h]
            else:
                self.media.clear()
        self.version += 1


class EventFeed:
    """Subscribes to replicas' KV events and keeps `state`'s digests from them."""

    POLL_MS = 50

    def __init__(self, state: ClusterState, context: zmq.Context | None = None):
        self.state = state
        self._ctx = context or zmq.Context.instance()
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._endpoints: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self.lag_seconds: deque[float] = deque(maxlen=10_000)
        self.applied_batches = 0
        self._applied = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-feed", daemon=True)
        self._thread.start()

    def track(self, replica_id: str, metadata: dict) -> None:
        """A replica advertised its events (again): subscribe when it is new or moved."""
        key = (metadata["endpoint"], metadata.get("replay_endpoint"))
        with self._lock:
            if self._endpoints.get(replica_id) == key:
                return
            old = self._replicas.pop(replica_id, None)
            if old is not None:
                old.sub.close()
            if metadata["block_size"] != self.state.block_tokens:
                log.warning("replica %s announces %d-token blocks, the router uses %d: its "
                            "events are ignored", replica_id, metadata["block_size"],
                            self.state.block_tokens)
                return
            sub = EventSubscriber(metadata["endpoint"], metadata.get("replay_endpoint"),
                                  metadata.get("topic", ""), metadata.get("encoding", "array"),
                                  context=self._ctx)
            self._replicas[replica_id] = _ReplicaBlocks(sub, self.state.block_tokens)
            self._endpoints[replica_id] = key

    def untrack(self, replica_id: str) -> None:
        with self._lock:
            gone = self._replicas.pop(replica_id, None)
            self._endpoints.pop(replica_id, None)
        if gone is not None:
            gone.sub.close()

    def wait_applied(self, num_batches: int, timeout_s: float) -> bool:
        """Block until `num_batches` batches in all were applied (tests, benchmarks)."""
        with self._applied:
            return self._applied.wait_for(lambda: self.applied_batches >= num_batches,
                                          timeout_s)

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        with self._lock:
            for r in self._replicas.values():
                r.sub.close()
            self._replicas.clear()

    def _run(self) -> None:
        while self._running:
            with self._lock:
                replicas = list(self._replicas.items())
            if not replicas:
                time.sleep(self.POLL_MS / 1000)     # nothing to read yet: idle period
                continue
            poller = zmq.Poller()
            for _, r in replicas:
                poller.register(r.sub.sub, zmq.POLLIN)
            try:
                ready = dict(poller.poll(self.POLL_MS))
                for rid, r in replicas:
                    got = []
                    if not r.caught_up:         # what it sent before we subscribed
                        r.caught_up = True
                        got = r.sub.catch_up()
                    if r.sub.sub in ready:
                        got += r.sub.receive(0)
                    if got:
                        self._apply(rid, r, got)
            except (zmq.ZMQError, TimeoutError) as exc:     # a replica gone: Ray will say
                log.warning("kv-event feed: %s", exc)

    def _apply(self, replica_id: str, r: _ReplicaBlocks, got: list) -> None:
        for item in got:
            r.apply(item.batch)
        now = time.time()
        self.lag_seconds.extend(now - item.batch.ts for item in got)
        digest = CacheDigest(frozenset(r.media), r.block_tokens, got[-1].batch.ts,
                             version=r.version)
        with self.state.lock:
            if replica_id in self.state.replicas:
                self.state.replica(replica_id).take_digest(digest, None)
        with self._applied:
            self.applied_batches += len(got)
            self._applied.notify_all()
