"""Keep freed host memory in the process, so CPU steps stop re-faulting their activations.

glibc hands blocks above its mmap threshold (128 KiB at start) straight back to the kernel
on free, and trims the heap top above its trim threshold. A CPU forward pass allocates
and frees tens of MB of activations per layer, so every step then page-faults them in
again: ~100,000 minor faults per 2,048-token prefill step, measured at about 40% of its
time on this project's VMs (2.2 s -> 1.4 s with the thresholds raised). Raising both
thresholds makes the allocator reuse that memory, as a caching allocator would; one arena
keeps the worker thread's blocks in the same reusable heap as the main thread's.

The cost is that the process keeps its high-water mark of freed activations (a few
hundred MB for SmolLM2 at a 2,048-token step) instead of returning it to the kernel.
That mark is bounded by the largest set of blocks live at once, not by how many requests
came: a step's activations by --chunked-prefill-size, a request being read by the server's
--max-body-bytes. Freed blocks are reused, so refused requests (which the server frees at
once, without waiting for a garbage collection) do not raise it: tests/server/test_hostile.py
asserts RSS within 10% of its level before a hostile mix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 1 << 30      # blocks below this come from the reusable heap
TRIM_THRESHOLD_BYTES = 2**31 - 1    # never shrink the heap for less (an int: the max)

_applied = False


def keep_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); False where not glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):       # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1),
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
    if not ok:
        log.warning("mallopt refused a setting: CPU steps may keep page-faulting activations")
    _applied = ok
    return ok
