"""EventPublisher: KV event batches out on ZeroMQ from a thread of the engine's process
(`--kv-events-publisher thread`; the default runs the same work in a process of its own:
process_publisher.py, child.py). The wire contract (sockets, sequence numbers, replays)
is EventWire's (wire.py).

The engine's step only appends an item to a bounded queue (`publish`); a thread turns it
into a batch (`prepare`: the engine queues its tree's raw changes and the thread computes
the events, events/tree_facts.py), encodes and sends it; items queued while it was busy
join into one batch (one encode, one send). When the queue is full (no thread
progress: a stuck send, a busy machine) the oldest item is dropped and counted
(`dropped_batches`, in /metrics) and `publish` says so, so that a producer whose items
depend on each other can put one self-contained item in place of the queue
(`replace_queued`). A slow or absent subscriber never blocks the engine (PUB itself drops
at its high-water mark).

The thread holds the GIL while it computes events, and beside a busy scheduler thread that
costs the step about 10% at 256 running (docs/benchmarks.md): the thread mode stays for
embedders and tests that drive the publisher in-process (the 100k-operation fuzz, the
stuck-send faults) and for hosts with a single core, where a second process gains nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from radixserve.events.wire import EventWire, PublisherStats, open_socket

__all__ = ["EventPublisher", "PublisherStats", "offset_endpoint_port", "open_socket"]

log = logging.getLogger(__name__)
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
        self.wire = EventWire(endpoint, replay_endpoint, topic, buffer_batches, hwm,
                              context, first_seq)
        self.endpoint = self.wire.endpoint
        self.replay_endpoint = self.wire.replay_endpoint
        self.topic = topic
        self.first_seq = self.wire.first_seq
        self.stats = self.wire.stats
        # SimpleQueue: put and the thread's wake-up are one C call each (a Condition
        # costs the producer ~10 us a batch in Python code).
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._max_queue = max_queue_batches
        self._sent = threading.Condition()
        self._accepted = 0          # items given to publish, dropped ones included
        self._handled = 0           # items the thread sent, found empty or failed on
        self._prepare = prepare
        self.resync_wanted = False  # an item failed: the producer should replace_queued
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    # publish, replace_queued and close are called from one thread (the engine's).
    def publish(self, batch, wake: bool = False) -> bool:
        """Queue one KVEventBatch (or item for `prepare`). Never blocks: a full queue drops
        its oldest item, and then this returns False. (`wake`: the process publisher's;
        this thread wakes for every item.)"""
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
        self.wire.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            self.wire.serve_replays()
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
                    self.stats.failed_batches += 1
                    self.resync_wanted = True
                with self._sent:
                    self._handled += len(items)
                    self.stats.cpu_s = time.thread_time()
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
        self.wire.send(batch)       # _run notifies the waiters once the item is done
