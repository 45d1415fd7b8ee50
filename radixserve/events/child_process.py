"""ChildProcess: one run of the publisher process (child.py) as the engine sees it: the
process, the ring its frames go through (a FrameRing), its stdin pipe (the doorbell that
wakes it when it sleeps, and whose end tells it to finish) and its counters (a
StatsBlock). ProcessPublisher (process_publisher.py) holds one at a time and starts
another when it dies.

Only the engine's thread puts frames while nothing is queued, and only the writer thread
while something is, so the ring has one writer at a time.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile

import radixserve
from radixserve.events.frame_ring import FrameRing
from radixserve.events.stats_block import StatsBlock

__all__ = ["ChildProcess", "memory_fd"]


def memory_fd(name: str) -> int:
    """A descriptor of a file held in memory only (a memfd: never written back to a disk,
    as the dirty pages of a temporary file would be), for a mapping shared with the child;
    an unlinked temporary file where the OS has no memfd."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, 0)     # inherited: not close-on-exec
    fd, path = tempfile.mkstemp(prefix=name)
    os.unlink(path)
    return fd


class ChildProcess:
    """Starts `python -m radixserve.events.child` with `config` (child.py's keys but
    stats_fd) and waits for its first line; RuntimeError with its reason if it did not
    start."""

    START_TIMEOUT_S = 120       # Python's start and imports, on a busy machine

    def __init__(self, config: dict, ring_bytes: int):
        self._stats_fd = memory_fd("radixserve-kv-events-stats")
        self.block = StatsBlock(self._stats_fd, create=True)
        self._ring_fd = memory_fd("radixserve-kv-events-ring")
        self.ring = FrameRing(self._ring_fd, ring_bytes, create=True)
        config = {**config, "stats_fd": self._stats_fd, "ring_fd": self._ring_fd,
                  "ring_bytes": ring_bytes}
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(radixserve.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "radixserve.events.child", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            pass_fds=(self._stats_fd, self._ring_fd))
        self.hello = self._hello()
        self.fd = self.process.stdin.fileno()
        os.set_blocking(self.fd, False)     # a doorbell never waits
        self.accepted = 0           # frames handed to this child (put or queued)
        self.doorbells = 0          # puts that woke it (asleep, or asked to)

    def _hello(self) -> dict:
        out = self.process.stdout
        ready, _, _ = select.select([out], [], [], self.START_TIMEOUT_S)
        line = out.readline() if ready else b""
        out.close()
        hello = json.loads(line) if line else {"error": "no answer (see its log above)"}
        if "error" in hello:
            self.process.kill()
            self.process.wait()
            self.process.stdin.close()
            self.close_block()
            raise RuntimeError(f"--kv-events: the publisher process did not start: "
                               f"{hello['error']}")
        return hello

    def room(self) -> int:
        """Bytes `put` can take now (at least)."""
        return self.ring.room()

    def put(self, data: bytes | bytearray | memoryview, wake: bool = False) -> None:
        """Copy `data` (at most `room` bytes) into the ring, and ring the doorbell if the
        child sleeps, or `wake`; OSError (EPIPE) if it has ended and so noticed."""
        self.ring.put(data)
        if wake or self.ring.child_sleeping():
            self.doorbells += 1
            try:
                os.write(self.fd, b"\0")
            except BlockingIOError:     # the pipe is full of doorbells: it will wake
                pass

    def ended(self) -> bool:
        return self.process.poll() is not None

    def handled(self) -> int:
        """Frames the child has read and published (or failed to)."""
        return int(self.block.get("handled_frames"))

    def close_pipe(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def close_block(self) -> None:
        """The shared mappings (the counters and the ring), once the child is gone."""
        self.block.close()
        os.close(self._stats_fd)
        self.ring.close()
        os.close(self._ring_fd)
