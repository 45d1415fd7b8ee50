"""Host <-> pool copies on a side CUDA stream, tracked by events.

On CUDA the tier mover (attention/kv_tiers.py) issues the pool <-> host-memory copies on a
stream of their own so they overlap the forward pass: device-to-host copies into pinned
host slots with `non_blocking=True`, an event recorded after each order. Two rules keep the
data right:
- the compute stream waits (`wait_event`) for what it depends on: after a demotion, the
  gather that read the freed pool pages (the forward may overwrite them next); after a
  load, the whole copy (the prefill reads the loaded pages);
- host memory is read by the CPU (a page going on to disk, a save) only after the copies
  writing it have completed (`CopyEvents.wait`).
`CopyEvents` is the bookkeeping: an order is *pending* until its event has completed
(`event.query()`), then *complete*; completed loads report their copy time. The stream
operations come through `StreamOps`, so a fake (tests on CPU) can stand in for CUDA.
"""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixserve.cache.tier_types import Move

__all__ = ["CopyEvents", "CudaStreamOps", "PendingCopy", "StreamOps"]


class StreamOps(Protocol):
    """The few stream calls the mover makes (torch.cuda's documented API)."""

    def compute(self) -> Any:
        """The stream the model runs on (the current one)."""

    def side(self) -> Any:
        """The copies' own stream."""

    def use(self, stream: Any) -> AbstractContextManager:
        """Make `stream` current for the ops issued inside."""

    def event(self) -> Any:
        """A new event (record(stream), query(), synchronize(), elapsed_time(end))."""


class CudaStreamOps:
    """StreamOps on a CUDA device: one side stream, timing events."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device=device)

    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def side(self) -> torch.cuda.Stream:
        return self._side

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)


@dataclass
class PendingCopy:
    """One order's copies: `done` recorded after them; `keep` holds the tensors they read
    or write (staging rows) alive until then; `started` for timing loads."""

    key: Move                   # the order's direction
    tokens: int
    started: Any
    done: Any
    keep: list = field(default_factory=list)


class CopyEvents:
    """Orders issued on the side stream, oldest first, pending until their event is done."""

    def __init__(self) -> None:
        self._pending: deque[PendingCopy] = deque()

    def add(self, copy: PendingCopy) -> None:
        self._pending.append(copy)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def poll(self) -> list[PendingCopy]:
        """The orders whose event has completed (one stream: they complete in order)."""
        done = []
        while self._pending and self._pending[0].done.query():
            done.append(self._pending.popleft())
        return done

    def wait(self) -> list[PendingCopy]:
        """Block until every pending order has completed; returns them."""
        if self._pending:
            self._pending[-1].done.synchronize()
        done = list(self._pending)
        self._pending.clear()
        return done
