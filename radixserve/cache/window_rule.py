"""WindowRule: which sliding-window KV a cached path keeps, and where a match may end.

A match may end at any page boundary m (and inside a page, for copy-on-write); to resume
there, a sliding-window layer needs the K/V of positions [m - W, m). Keeping that for every
m would keep every token's windowed KV, so the tree keeps the windows of *match points*
only (docs/models.md, "Window-aware cache"):

- every point m <= W: the first W tokens' windows (cheap, and where system prompts start);
- a checkpoint every `checkpoint` tokens (a multiple of the page size): a long path with
  no branch still has a point to resume from at most `checkpoint` tokens back;
- each request's branch point: the last whole page its prompt shared with the tree (where
  the next request with that prefix will diverge too);
- each request's end: the last whole page it inserted (the next turn of a conversation).

A match ends at the largest point whose window is present in the tree (`usable_point`),
never past it. Windows are kept per point, so losing one point's window (eviction) loses
that point only: every earlier point keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WindowRule"]


@dataclass(frozen=True)
class WindowRule:
    window: int         # W, tokens
    page_size: int
    checkpoint: int     # tokens between checkpoints, a multiple of page_size

    def __post_init__(self) -> None:
        if self.window < 1 or self.checkpoint < 1 or self.checkpoint % self.page_size:
            raise ValueError(f"window {self.window} and checkpoint {self.checkpoint} must be "
                             f"positive, the checkpoint a multiple of the page size "
                             f"{self.page_size}")

    @classmethod
    def of(cls, window: int, page_size: int, checkpoint: int | None,
           checkpoint_windows: int) -> WindowRule:
        """`checkpoint` tokens (None: `checkpoint_windows` windows), rounded up to pages."""
        c = checkpoint if checkpoint is not None else window * checkpoint_windows
        return cls(window, page_size, -(-max(c, 1) // page_size) * page_size)

    def needed_pages(self, point: int) -> tuple[int, int]:
        """Page index range [lo, hi) whose windowed KV resuming at `point` reads."""
        ps = self.page_size
        return max(0, point - self.window) // ps, -(-point // ps)

    def kept(self, pages: np.ndarray, branch: int = 0) -> np.ndarray:
        """bool per page index: the page lies in the window of a match point the tree keeps
        (first window, a checkpoint, or `branch`; ends are the caller's: its live window)."""
        ps, w, c = self.page_size, self.window, self.checkpoint
        start = pages.astype(np.int64) * ps
        end = start + ps
        keep = start < w
        next_checkpoint = (start // c + 1) * c
        keep |= next_checkpoint - w < end
        if branch > 0:
            keep |= (branch - w < end) & (start < branch)
        return keep

    def usable_point(self, present: np.ndarray, matched: int) -> int:
        """The largest point m <= `matched` whose window is present: `present` is a bool per
        page of the match (the copy-on-write page last when `matched` is inside a page).
        m is `matched` itself or a page boundary; 0 when none has its window."""
        ps = self.page_size
        missing = np.concatenate(([0], np.cumsum(~present, dtype=np.int64)))
        lo, hi = self.needed_pages(matched)
        if missing[hi] == missing[lo]:
            return matched
        ks = np.arange(matched // ps, 0, -1, dtype=np.int64)       # boundaries, largest first
        los = np.maximum(0, ks * ps - self.window) // ps
        ok = np.flatnonzero(missing[ks] == missing[los])
        return int(ks[ok[0]]) * ps if len(ok) else 0
