"""ChildProcess: one run of the publisher process (child.py) as the engine sees it: the
process, its stdin pipe (non-blocking on the engine's side) and its counters (a
StatsBlock). ProcessPublisher (process_publisher.py) holds one at a time and starts
another when it dies.

The pipe's room is known without a syscall: the bytes written less those the child says
it read (StatsBlock.read_bytes; it may have read more since: then there is more room,
never less). Only the engine's thread writes while nothing is queued, and only the
writer thread while something is, so each count has one writer.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import tempfile

import radixserve
from radixserve.events.stats_block import StatsBlock

__all__ = ["ChildProcess"]

_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032     # Linux fcntl: a pipe's capacity
# Room left unused in the pipe: it holds whole pages, and the page the child is reading
# and the one last written are partly empty, so its room in bytes is a little less.
_PIPE_SLACK = 16 << 10


class ChildProcess:
    """Starts `python -m radixserve.events.child` with `config` (child.py's keys but
    stats_fd) and waits for its first line; RuntimeError with its reason if it did not
    start."""

    START_TIMEOUT_S = 120       # Python's start and imports, on a busy machine

    def __init__(self, config: dict, pipe_bytes: int):
        self._stats_file = tempfile.TemporaryFile()
        self.block = StatsBlock(self._stats_file.fileno(), create=True)
        config = {**config, "stats_fd": self._stats_file.fileno()}
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(radixserve.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "radixserve.events.child", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            pass_fds=(self._stats_file.fileno(),))
        self.hello = self._hello()
        self.fd = self.process.stdin.fileno()
        try:
            fcntl.fcntl(self.fd, _F_SETPIPE_SZ, pipe_bytes)
        except OSError:             # above /proc/sys/fs/pipe-max-size: keep the default
            pass
        self._pipe_bytes = fcntl.fcntl(self.fd, _F_GETPIPE_SZ)
        os.set_blocking(self.fd, False)     # the step's own writes never wait
        self.accepted = 0           # frames handed to this child (written or queued)
        self.bytes_now = 0          # bytes written by the engine's thread
        self.bytes_later = 0        # bytes written by the writer thread

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
        """Bytes the pipe can take now without a partial write (at least)."""
        used = self.bytes_now + self.bytes_later - self.block.get("read_bytes")
        return self._pipe_bytes - _PIPE_SLACK - used

    def handled(self) -> int:
        """Frames the child has read and published (or failed to)."""
        return int(self.block.get("handled_frames"))

    def close_pipe(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def close_block(self) -> None:
        self.block.close()
        self._stats_file.close()
