"""ProcessPublisher: the engine's side of the publisher process (child.py), with the
producer interface of EventPublisher (publisher.py), so KVEvents (stream.py) drives either.

Why a process: in a thread, computing the events (shadow tree, block hashes, token lists,
msgpack) holds the GIL beside the scheduler's thread, and at 256 running that cost the
step ~10% (docs/benchmarks.md); the child does that work on another core. What stays on
the engine's thread per step: the tree facts' capture, one msgspec encode of them
(fact_messages.py) and, when the pipe has room for the whole frame (the bytes written
less those the child says it read: StatsBlock.read_bytes) and nothing waits before it,
one non-blocking write of it (the pipe holds 1 MiB: ~80 churn steps). Only
when it has not (the child fell behind) does the frame go to a bounded queue that a
writer thread empties into the pipe, waiting there without the GIL, never the step; so
in the steady state no second thread of the engine wakes, and none asks the scheduler's
thread for the GIL. When the queue is full the oldest frame is dropped and counted, and
`publish` says so (the caller then queues a snapshot: stream.py). The child's counters
come back through a StatsBlock (stats_block.py).

Faults: a child that cannot bind its endpoints fails the engine's start with its error;
a child that dies later is logged once and counted (`publisher_exits`), and from then on
frames are dropped (counted) and the engine runs on without events. `close` writes what
is queued, ends the pipe, and waits for the child (killed after `timeout_s`): no zombie.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time

import radixserve
from radixserve.events.fact_messages import FactEncoder
from radixserve.events.stats_block import StatsBlock
from radixserve.events.wire import PublisherStats

__all__ = ["ProcessPublisher"]

log = logging.getLogger(__name__)
_STOP = object()                # queued by close: the writer ends the pipe after the rest
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032     # Linux fcntl: a pipe's capacity
_POLL_S = 0.002                 # wait_* read the child's counters this often
# Room left unused in the pipe: it holds whole pages, and the page the child is reading
# and the one last written are partly empty, so its room in bytes is a little less.
_PIPE_SLACK = 16 << 10


class ProcessPublisher:
    """Starts the child with `child_config` (child.py's keys but stats_fd) and feeds it
    each `publish`ed step's facts."""

    START_TIMEOUT_S = 120       # Python's start and imports, on a busy machine
    MAX_WRITE_BYTES = 1 << 20   # frames joined into one write

    def __init__(self, child_config: dict, max_queue_batches: int = 4096,
                 pipe_bytes: int = 1 << 20):
        self._stats_file = tempfile.TemporaryFile()
        self._block = StatsBlock(self._stats_file.fileno(), create=True)
        config = {**child_config, "stats_fd": self._stats_file.fileno()}
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(radixserve.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.process = self._child = subprocess.Popen(
            [sys.executable, "-m", "radixserve.events.child", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            pass_fds=(self._stats_file.fileno(),))
        hello = self._hello()
        self.endpoint = hello["endpoint"]
        self.replay_endpoint = hello["replay_endpoint"]
        self.first_seq = hello["first_seq"]
        self.topic = child_config["topic"]
        self.child_imported_torch = hello["torch_loaded"]
        self._fd = self._child.stdin.fileno()
        try:
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, pipe_bytes)
        except OSError:             # above /proc/sys/fs/pipe-max-size: keep the default
            pass
        self._pipe_bytes = fcntl.fcntl(self._fd, _F_GETPIPE_SZ)
        os.set_blocking(self._fd, False)    # the step's own writes never wait
        self._encoder = FactEncoder()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._max_queue = max_queue_batches
        self._accepted = 0          # frames given to publish, dropped ones included
        self._dropped = 0           # frames dropped from a full queue (engine's thread)
        self._queued = 0            # frames put on the queue (engine's thread)
        self._written = 0           # frames the writer took off it and wrote (writer's)
        self._bytes_now = 0         # bytes written by the engine's thread itself
        self._bytes_later = 0       # bytes written by the writer thread
        self._failures_seen = 0     # the child's failed batches already answered
        self._exited = False        # the child ended before close
        self._closing = False
        self._final_stats: PublisherStats | None = None
        self.writer_cpu_s = 0.0     # the writer thread's CPU so far (bench_scheduler.py)
        self.writer_wakes = 0       # times the writer thread woke to write (same)
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-events-writer",
                                        daemon=True)
        self._writer.start()

    def _hello(self) -> dict:
        """The child's first line: where it listens; a RuntimeError with its reason if
        it could not start."""
        out = self._child.stdout
        ready, _, _ = select.select([out], [], [], self.START_TIMEOUT_S)
        line = out.readline() if ready else b""
        out.close()
        hello = json.loads(line) if line else {"error": "no answer (see its log above)"}
        if "error" in hello:
            self._child.kill()
            self._child.wait()
            self._child.stdin.close()
            self._block.close()
            self._stats_file.close()
            raise RuntimeError(f"--kv-events: the publisher process did not start: "
                               f"{hello['error']}")
        return hello

    # ------------------------------------------------------------------ producer side
    # publish, replace_queued and close are called from one thread (the engine's).
    def publish(self, facts: list[tuple]) -> bool:
        """Hand one step's facts to the child as a frame: written into the pipe now when
        nothing waits before it and it fits, else queued for the writer thread. Never
        blocks: a full queue drops its oldest frame, and then this returns False. After
        the child died: dropped, counted."""
        self._accepted += 1
        if self._exited:            # counted as dropped (stats)
            return True             # no snapshot: nobody would read it
        frame = self._encoder.frame(facts)
        if self._queued == self._written + self._dropped and self._write_now(frame):
            return True
        full = self._queue.qsize() >= self._max_queue
        if full:
            self._drop(1)
        self._queued += 1
        self._queue.put(frame)
        return not full

    def _write_now(self, frame: bytes) -> bool:
        """(Nothing queued or being written.) Write `frame` whole if the pipe has room for
        it: then no partial frame can be left for the writer (only this process writes).
        The room is known from the bytes the child read (it may have read more since:
        then there is more room, never less)."""
        used = self._bytes_now + self._bytes_later - self._block.get("read_bytes")
        if self._pipe_bytes - _PIPE_SLACK - used < len(frame):
            return False
        try:
            n = os.write(self._fd, frame)       # room enough: never partial
            self._bytes_now += n
            if n < len(frame):      # never seen; the writer finishes the frame
                log.warning("kv-events: a partial write to the publisher pipe (%d of %d "
                            "bytes): its room was overestimated", n, len(frame))
                self._queued += 1
                self._queue.put(frame[n:])
            return True
        except OSError:             # EPIPE: the child ended (counted in stats)
            self._note_exit()
            return True

    def replace_queued(self, facts: list[tuple]) -> None:
        """Drop every queued frame (counted) and queue `facts` alone (a snapshot)."""
        self._failures_seen = int(self._block.get("failed_batches"))
        self._drop(self._queue.qsize())
        self.publish(facts)

    @property
    def resync_wanted(self) -> bool:
        """The child failed a batch since the last replace_queued."""
        return self._block.get("failed_batches") > self._failures_seen

    def _drop(self, n: int) -> None:
        for _ in range(n):
            try:
                self._queue.get_nowait()
            except queue.Empty:         # the writer took them meanwhile
                break
            self._dropped += 1

    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def stats(self) -> PublisherStats:
        if self._final_stats is not None:       # closed: the child's last counts
            return self._final_stats
        c = self._block.read()
        # After the child ended, every frame it did not handle is lost (some were in the
        # pipe, some queued, some published since).
        dropped = (self._accepted - int(c["handled_frames"]) if self.exited()
                   else self._dropped)
        return PublisherStats(
            published_batches=int(c["published_batches"]), dropped_batches=dropped,
            published_bytes=int(c["published_bytes"]),
            replay_requests=int(c["replay_requests"]),
            bad_replay_requests=int(c["bad_replay_requests"]), cpu_s=c["cpu_s"],
            failed_batches=int(c["failed_batches"]), publisher_exits=int(self.exited()))

    def child_wakes(self) -> int:
        """The child's voluntary context switches so far: how often it slept and woke
        (bench_scheduler.py)."""
        return int(self._block.get("wakes"))

    def exited(self) -> bool:
        """Whether the child ended before close (logged once when first seen)."""
        if not self._exited and not self._closing and self._child.poll() is not None:
            self._note_exit()
        return self._exited

    def _note_exit(self) -> None:
        with self._lock:
            if self._exited or self._closing:
                return
            self._exited = True
        log.error("kv-events: the publisher process (pid %d) ended (exit status %s); "
                  "the engine runs on without KV events", self._child.pid, self._child.poll())

    def _wait(self, done, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.exited() or time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the child handled every frame published so far, or it was dropped
        (False at the timeout, or if the child ended)."""
        return self._wait(lambda: self._block.get("handled_frames") + self._dropped
                          >= self._accepted, timeout_s)

    def sent_when_idle(self, timeout_s: float = 30) -> int:
        """The batches sent in all once every frame published so far was handled;
        TimeoutError if the child is stuck or gone."""
        if not self.wait_idle(timeout_s):
            raise TimeoutError("the kv-events process did not finish its queue in time")
        return int(self._block.get("published_batches"))

    def wait_sent(self, num_batches: int, timeout_s: float) -> bool:
        """Block until `num_batches` batches in all were sent (False at the timeout)."""
        return self._wait(lambda: self._block.get("published_batches") >= num_batches,
                          timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued and end the pipe; the child sends it and exits (killed
        after `timeout_s`); reaped either way."""
        self._queue.put(_STOP)
        self._writer.join(timeout_s)
        self._closing = True
        try:
            self._child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("kv-events: the publisher process did not end in %.0f s: killed",
                        timeout_s)
            self._child.kill()
            self._child.wait()
        self._writer.join(timeout_s)    # a write stuck on a stopped child: broken now
        self._final_stats = self.stats
        self._block.close()
        self._stats_file.close()

    # ------------------------------------------------------------------ the writer thread
    def _write_loop(self) -> None:
        stop = False
        while not stop:
            frames = [self._queue.get()]
            self.writer_wakes += 1
            size = len(frames[0]) if frames[0] is not _STOP else 0
            while size < self.MAX_WRITE_BYTES:      # what queued meanwhile: one write
                try:
                    frame = self._queue.get_nowait()
                except queue.Empty:
                    break
                frames.append(frame)
                if frame is not _STOP:
                    size += len(frame)
            if _STOP in frames:
                stop = True
                frames = frames[:frames.index(_STOP)]
            if not self._write(b"".join(frames)):
                self._drain()       # counted in stats: every frame the child did not handle
                return
            self._written += len(frames)
            self._bytes_later += sum(map(len, frames))
            self.writer_cpu_s = time.thread_time()
        self._close_pipe()

    def _write(self, data: bytes) -> bool:
        """All of `data` into the pipe, waiting (without the GIL) while it is full; False
        if the child is gone."""
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(self._fd, view):]
                except BlockingIOError:
                    select.select([], [self._fd], [])
        except OSError:             # EPIPE: the child ended
            self._note_exit()
            self._close_pipe()
            return False
        return True

    def _drain(self) -> None:
        """(The child is gone.) Free every queued frame."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _close_pipe(self) -> None:
        try:
            self._child.stdin.close()
        except OSError:
            pass
