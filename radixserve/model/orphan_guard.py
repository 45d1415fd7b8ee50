"""exit_with_parent: a worker process that ends when the process that started it ends.

A background worker (the decode compile, model/compiled_decode.py) runs for minutes. If
the server is killed (SIGKILL, an OOM kill) it gets no chance to stop it, and the worker
would go on compiling for nobody. The parent starts it with `stdin=subprocess.PIPE` and
never writes: the kernel closes the pipe's write end when the parent ends, however it
ends, and a thread here, blocked on reading stdin, sees the end of file and exits the
process. No polling, no signal, nothing Linux-only.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["ORPHANED_EXIT", "exit_with_parent"]

ORPHANED_EXIT = 3       # the worker's exit status when its parent went first


def _wait_for_end_of_input(fd: int) -> None:
    try:
        while os.read(fd, 4096):    # the parent writes nothing; bytes would be ignored
            pass
    except OSError:
        pass
    os._exit(ORPHANED_EXIT)         # not SystemExit: the main thread may be in C for minutes


def exit_with_parent() -> None:
    """Exit this process (status ORPHANED_EXIT) once its stdin reaches end of file: the
    parent that holds the pipe's write end ended, or closed it to say stop."""
    threading.Thread(target=_wait_for_end_of_input, args=(sys.stdin.fileno(),),
                     name="orphan-guard", daemon=True).start()
