"""ProcessPublisher: the engine's side of the publisher process (child.py), with the
producer interface of EventPublisher (publisher.py), so KVEvents (stream.py) drives either.

Why a process: in a thread, computing the events (shadow tree, block hashes, token lists,
msgpack) holds the GIL beside the scheduler's thread, and at 256 running that cost the
step ~10% (docs/benchmarks.md); the child does that work on another core. What stays on
the engine's thread per hand-over: the tree facts' capture, one msgspec encode of them
(fact_messages.py) and, when the ring has room for the whole frame and nothing waits
before it, one copy of it into the ring the child reads (frame_ring.py: shared memory, no
syscall; the child drains it on its own timer, and only a child that sleeps, or an
engine going idle, wakes it, by a byte on its stdin pipe). Only when it has not (the
child fell behind) does the frame go to a bounded queue that a writer thread empties into
the ring as room comes, never the step. When the queue is full the oldest frame is
dropped and counted, and `publish` says so (the caller then queues a snapshot:
stream.py). The child's counters come back through a StatsBlock (stats_block.py).

Faults: a child that cannot bind its endpoints fails the engine's start with its error.
A child that dies later (seen at the next hand-over: the ring cannot tell, so each asks
the kernel, one waitpid) is logged and counted (`publisher_exits`) and restarted on the
same endpoints, at most 3 times in 60 s (restart_budget.py; counted:
`publisher_restarts`; beyond that the engine runs on without events). The start happens
on a thread of its own (the engine's step never waits for Python to start); meanwhile
frames are dropped (counted). The new child's first batch is a snapshot of the tree,
AllBlocksCleared and then every block held (`resync_wanted`, stream.py), since its
subscribers missed what happened meanwhile; its sequence numbers start above the old
child's (wire.py: microseconds since the epoch), so a subscriber sees a gap, asks for a
replay and gets the new stream from that clear. `close` puts what is queued, ends the
pipe (the child drains the ring and exits), and waits for the child (killed after
`timeout_s`): no zombie.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import threading
import time

from radixserve.events.child_process import ChildProcess
from radixserve.events.fact_messages import FactEncoder
from radixserve.events.restart_budget import RestartBudget
from radixserve.events.wire import PublisherStats

__all__ = ["ProcessPublisher"]

log = logging.getLogger(__name__)
_STOP = object()                # queued by close: the writer ends the pipe after the rest
_POLL_S = 0.002                 # wait_* read the child's counters this often
_ROOM_WAIT_S = (0.0005, 0.010)  # the writer thread's waits for room: first, longest
_COUNTS = ("published_batches", "published_bytes", "replay_requests",
           "bad_replay_requests", "failed_batches")   # summed over the children


class ProcessPublisher:
    """Starts the child with `child_config` (child.py's keys but stats_fd) and feeds it
    each `publish`ed step's facts."""

    MAX_WRITE_BYTES = 1 << 20   # frames joined into one put

    def __init__(self, child_config: dict, max_queue_batches: int = 4096,
                 ring_bytes: int = 1 << 20):
        self._ring_bytes = ring_bytes
        self._child = ChildProcess(child_config, ring_bytes)
        hello = self._child.hello
        self.endpoint = hello["endpoint"]
        self.replay_endpoint = hello["replay_endpoint"]
        self.first_seq = hello["first_seq"]
        self.topic = child_config["topic"]
        self.child_imported_torch = hello["torch_loaded"]
        # A restarted child binds the endpoints this one has (a wildcard port resolved),
        # its numbers from the clock again.
        self._restart_config = {**child_config, "endpoint": self.endpoint,
                                "replay_endpoint": self.replay_endpoint, "first_seq": None}
        self._encoder = FactEncoder()
        # Its unfinished_tasks: frames queued and not yet written or dropped.
        self._queue: queue.Queue = queue.Queue()
        self._max_queue = max_queue_batches
        self._dropped = 0           # dropped by the engine: a full queue, or no child
        self._past = dict.fromkeys(_COUNTS + ("cpu_s", "lost"), 0)  # dead children's
        self._failures_seen = 0     # the child's failed batches already answered
        self._down = False          # the current child ended (before close)
        self._exits = 0
        self._restarts = 0
        self.restart_budget = RestartBudget()
        self._fresh: ChildProcess | None = None     # restarted, not yet taken in
        self._restarted = threading.Event()         # set with _fresh (tests wait on it)
        self._restarter: threading.Thread | None = None
        self._closing = False
        self._final_stats: PublisherStats | None = None
        self.writer_cpu_s = 0.0     # the writer thread's CPU so far (bench_scheduler.py)
        self.writer_wakes = 0       # times the writer thread woke to write (same)
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-events-writer",
                                        daemon=True)
        self._writer.start()

    @property
    def process(self) -> subprocess.Popen:
        """The child process running now (or the one that died, until its restart)."""
        return self._child.process

    # ------------------------------------------------------------------ producer side
    # publish, replace_queued and close are called from one thread (the engine's).
    def publish(self, facts: list[tuple], wake: bool = False) -> bool:
        """Hand one step's facts to the child as a frame: put into the ring now when
        nothing waits before it and it fits, else queued for the writer thread. Never
        blocks: a full queue drops its oldest frame, and then this returns False. While
        no child runs: dropped, counted. `wake`: wake the child now even if it is
        draining on its timer (the engine went idle: consumers should not wait a drain)."""
        if self._down:
            self._dropped += 1
            return True             # no snapshot now: the restart sends one
        child = self._child
        frame = self._encoder.frame_in_buffer(facts)      # reused: copied if queued
        child.accepted += 1
        if self._queue.unfinished_tasks == 0 and self._write_now(child, frame, wake):
            return True
        full = self._queue.qsize() >= self._max_queue
        if full:
            self._drop(1)
        self._queue.put(bytes(frame))
        return not full

    def _write_now(self, child: ChildProcess, frame: bytes | bytearray, wake: bool) -> bool:
        """(Nothing queued or being put.) Put `frame` whole if the ring has room for it
        (False: it has not). A child found ended is noticed; the frame is lost with it."""
        if child.room() < len(frame):
            return False
        if child.ended():
            self._note_exit(child)
            return True
        try:
            child.put(frame, wake)
        except OSError:             # EPIPE on the doorbell: the child ended
            self._note_exit(child)
        return True

    def replace_queued(self, facts: list[tuple]) -> None:
        """Drop every queued frame (counted) and queue `facts` alone (a snapshot); first
        take a restarted child in, if one is ready."""
        if self._fresh is not None and self._queue.unfinished_tasks == 0:
            self._take_fresh()
        self._failures_seen = int(self._child.block.get("failed_batches"))
        self._drop(self._queue.qsize())
        self.publish(facts, wake=True)

    @property
    def resync_wanted(self) -> bool:
        """The child failed a batch since the last replace_queued, or a restarted child
        is ready (and the dead one's frames are gone): it needs the whole tree."""
        if self._fresh is not None:
            return self._queue.unfinished_tasks == 0
        return (not self._down
                and self._child.block.get("failed_batches") > self._failures_seen)

    def _drop(self, n: int) -> None:
        for _ in range(n):
            try:
                self._queue.get_nowait()
            except queue.Empty:         # the writer took them meanwhile
                break
            self._queue.task_done()
            self._child.accepted -= 1   # never given to it after all
            self._dropped += 1

    def queued(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------ restarts
    def _note_exit(self, child: ChildProcess) -> None:
        """`child` ended before close: logged, counted, restarted if the policy allows."""
        with self._lock:
            if child is not self._child or self._down or self._closing:
                return
            self._down = True
            self._exits += 1
            restart = self.restart_budget.take()
            if restart:
                self._restarter = threading.Thread(target=self._restart,
                                                   name="kv-events-restart", daemon=True)
                self._restarter.start()
        log.error("kv-events: the publisher process (pid %d) ended (exit status %s); %s",
                  child.process.pid, child.process.poll(),
                  "restarting it" if restart else
                  f"restarted {self.restart_budget.describe()} already: the engine runs on "
                  f"without KV events")

    def _restart(self) -> None:
        """(Its own thread.) A new child on the same endpoints, handed to the engine's
        thread (`replace_queued`) once it listens."""
        try:
            fresh = ChildProcess(self._restart_config, self._ring_bytes)
        except (RuntimeError, OSError) as exc:
            log.error("kv-events: the publisher process could not be restarted: %s", exc)
            return
        with self._lock:
            if not self._closing:
                self._fresh = fresh
                self._restarted.set()
                log.warning("kv-events: the publisher process restarted (pid %d); its "
                            "first batch announces the whole cache", fresh.process.pid)
                return
        _end(fresh, 5.0)        # closed meanwhile

    def _take_fresh(self) -> None:
        """(Engine's thread; nothing queued.) The restarted child replaces the dead one,
        whose counters are kept."""
        old, fresh = self._child, self._fresh
        _end(old, 5.0, close_block=False)       # gone already: reaped at once
        counts = old.block.read()
        for name in _COUNTS + ("cpu_s",):
            self._past[name] += counts[name]
        self._past["lost"] += old.accepted - int(counts["handled_frames"])
        old.close_block()
        with self._lock:
            self._child, self._fresh = fresh, None
            self._restarted.clear()
            self._down = False
            self._restarts += 1
        self.first_seq = fresh.hello["first_seq"]
        self._failures_seen = 0

    def wait_restarted(self, timeout_s: float) -> bool:
        """Block until a restarted child listens (tests; False at the timeout)."""
        return self._restarted.wait(timeout_s)

    # ------------------------------------------------------------------ state
    @property
    def stats(self) -> PublisherStats:
        if self._final_stats is not None:       # closed: the last counts
            return self._final_stats
        child = self._child
        c = child.block.read()
        # A child that ended lost every frame it did not handle (in the pipe or queued).
        lost = self._past["lost"] + (
            child.accepted - int(c["handled_frames"]) if self.exited() else 0)
        now = {name: int(self._past[name] + c[name]) for name in _COUNTS}
        return PublisherStats(**now, dropped_batches=self._dropped + lost,
                              cpu_s=self._past["cpu_s"] + c["cpu_s"],
                              publisher_exits=self._exits,
                              publisher_restarts=self._restarts)

    def child_wakes(self) -> int:
        """The child's voluntary context switches so far: how often it slept and woke
        (bench_scheduler.py)."""
        return int(self._child.block.get("wakes"))

    def exited(self) -> bool:
        """Whether the child running now ended before close (logged when first seen)."""
        child = self._child
        if not self._down and not self._closing and child.process.poll() is not None:
            self._note_exit(child)
        return self._down

    def _wait(self, done, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.exited() or time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the child handled every frame given to it (False at the timeout,
        or if it ended)."""
        child = self._child
        return self._wait(lambda: child.handled() >= child.accepted, timeout_s)

    def sent_when_idle(self, timeout_s: float = 30) -> int:
        """The batches the running child sent (from `first_seq` on) once it handled every
        frame given to it; TimeoutError if it is stuck or gone."""
        if not self.wait_idle(timeout_s):
            raise TimeoutError("the kv-events process did not finish its queue in time")
        return int(self._child.block.get("published_batches"))

    def wait_sent(self, num_batches: int, timeout_s: float) -> bool:
        """Block until the running child sent `num_batches` batches (False at the
        timeout)."""
        block = self._child.block
        return self._wait(lambda: block.get("published_batches") >= num_batches, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Put what is queued and end the pipe; the child sends it and exits (killed
        after `timeout_s`); reaped either way, and a restarted child not taken in too."""
        self._queue.put(_STOP)
        self._writer.join(timeout_s)
        with self._lock:
            self._closing = True
            restarter = self._restarter
        if restarter is not None:
            restarter.join()    # bounded by ChildProcess.START_TIMEOUT_S
        if self._fresh is not None:
            _end(self._fresh, timeout_s)
        _end(self._child, timeout_s, close_block=False)
        self._writer.join(timeout_s)    # a put waiting on a stopped child: it sees the end
        self._final_stats = self.stats
        self._child.close_block()

    # ------------------------------------------------------------------ the writer thread
    def _write_loop(self) -> None:
        while True:
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
            stop = _STOP in frames
            data = [f for f in frames if f is not _STOP]
            # A child that ended loses these frames (counted in stats).
            self._write(self._child, b"".join(data))
            for _ in frames:
                self._queue.task_done()
            self.writer_cpu_s = time.thread_time()
            if stop:
                self._child.close_pipe()
                return

    def _write(self, child: ChildProcess, data: bytes) -> bool:
        """All of `data` into the ring, as room comes (the child drains it; this thread
        sleeps meanwhile, longer each time, without the GIL); False if the child is
        gone."""
        view = memoryview(data)
        pause = _ROOM_WAIT_S[0]
        while view:
            n = min(child.room(), len(view))
            if n > 0:
                try:
                    child.put(view[:n], wake=True)      # it is behind: no time to lose
                except OSError:     # EPIPE on the doorbell: the child ended
                    self._note_exit(child)
                    return False
                view = view[n:]
                pause = _ROOM_WAIT_S[0]
            elif child.ended():
                self._note_exit(child)
                return False
            else:
                time.sleep(pause)
                pause = min(2 * pause, _ROOM_WAIT_S[1])
        return True


def _end(child: ChildProcess, timeout_s: float, close_block: bool = True) -> None:
    """End `child`'s pipe and reap it (killed after `timeout_s`)."""
    child.close_pipe()
    try:
        child.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("kv-events: the publisher process did not end in %.0f s: killed",
                    timeout_s)
        child.process.kill()
        child.process.wait()
    if close_block:
        child.close_block()
