"""The one thread that does the engine's torch work: loading weights, building the KV pool,
and every forward pass.

Why one thread: CPU torch parallelizes with OpenMP (libgomp), which gives every thread that
starts parallel work its own team of helper threads. Load the model on the main thread and
run forwards on a worker, and the process holds two teams: more OpenMP threads than cores.
libgomp then stops spinning between parallel regions (its "throttled" wait) and wakes its
helpers through the kernel for each of the thousands of regions in a step. Measured with
scripts/bench_engine.py on the 2-core CI machines: decode steps ~2x and the whole run ~1.4x
slower than with loading and forwards on the same thread.

The event loop never waits on this thread synchronously except at start-up; steps go
through `loop.run_in_executor(compute_executor(), ...)`. Several engines in one process
(tests) share the thread, so their steps never compete for the cores.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

__all__ = ["compute_executor", "on_compute_thread"]

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_id: int | None = None


def _remember_thread() -> None:
    global _thread_id
    _thread_id = threading.get_ident()


def compute_executor() -> ThreadPoolExecutor:
    """The process's compute thread, as a one-worker executor (started on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-compute",
                                           initializer=_remember_thread)
        return _executor


def on_compute_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run `fn` on the compute thread and return its result (inline if already there)."""
    if threading.get_ident() == _thread_id:
        return fn(*args, **kwargs)
    return compute_executor().submit(fn, *args, **kwargs).result()
