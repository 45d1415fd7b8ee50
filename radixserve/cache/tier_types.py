"""The tiers' vocabulary: which tier (`Tier`), which direction (`Move`), which id (`TreeId`,
`SlotId`), and the seam the radix tree calls when a node changes tier (`TierHooks`).

Imports nothing from the tree: radix_cache.py and tiers.py both import this module, never
each other at run time, so the tree knows *that* a leaf may go somewhere else on eviction
but not *where*.

Ids, one name each:
- `TreeId`: what `TreeNode.pages` holds. One id space for all tiers (`[0, pool)` pool
  pages, then host slots, then disk slots, see tiers.py), so ids of two tiers never
  collide and conservation checks see every id once.
- `SlotId`: a tier's own index of a page (`LowerTiers.local(tier, tree_ids)`): a pool page,
  a host slot, a disk slot. Orders, the disk writer and the disk reader carry `SlotId`s.
  A disk slot is *not* the name of the page's file: `DiskPageStore` names files by a
  *page key*, a number never reused (a saved index must never name a later write), while
  slots are reused as pages come and go; `TierPages` (storage/tier_pages.py) maps each
  disk slot to the page key of the file holding it now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, NewType, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from .tree_node import TreeNode

__all__ = ["Tier", "Move", "MoveTimes", "TreeId", "SlotId", "TierHooks", "LOWER_TIERS"]

TreeId = NewType("TreeId", int)
SlotId = NewType("SlotId", int)


class Tier(IntEnum):
    """Where a node's pages are: the KV pool the model reads, host memory, disk.

    An IntEnum: lower tiers compare greater (`node.tier > Tier.POOL` is "not in the pool"),
    and the values are the "l1".."l3" of the stats the API returns."""

    POOL = 1
    HOST = 2
    DISK = 3

    @property
    def label(self) -> str:
        """The name the stats and metrics use: "l1", "l2", "l3"."""
        return f"l{self.value}"


LOWER_TIERS = (Tier.HOST, Tier.DISK)


@dataclass(frozen=True, slots=True)
class Move:
    """A direction pages travel in: `Move(Tier.HOST, Tier.POOL)` is a load from host.

    Hashable (a dict key for per-direction timings); `str()` is the label the stats use,
    "l2->l1"."""

    src: Tier
    dst: Tier

    def __str__(self) -> str:
        return f"{self.src.label}->{self.dst.label}"

    @property
    def is_load(self) -> bool:
        return self.dst == Tier.POOL


@dataclass
class MoveTimes:
    """What one step's orders moved: tokens and seconds by direction (the runner's
    TierMover measures them; the engine's tier runtime feeds the load costs with them)."""

    tokens: dict[Move, int] = field(default_factory=dict)
    seconds: dict[Move, float] = field(default_factory=dict)

    def add(self, key: Move, tokens: int, seconds: float) -> None:
        self.tokens[key] = self.tokens.get(key, 0) + tokens
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds


class TierHooks(Protocol):
    """What the radix tree asks of whatever lives below its KV pool.

    The tree is tier-agnostic: it keeps pool nodes and the counters of the pool, and calls
    these at the moments a node may change tier. `RadixCache` starts with `PoolOnly` hooks
    (an evicted page is gone); `LowerTiers` (tiers.py) attaches its own with
    `RadixCache.attach_tiers`. The second group is what requests and the step call
    (PrefixLease.load, the engine's step): with `PoolOnly` it does nothing.
    """

    # -- called by the tree
    def evict_leaf(self, leaf: TreeNode, need_pages: int) -> np.ndarray:
        """The tree chose `leaf` (an unlocked pool leaf, first in policy order) and still
        needs `need_pages` pages: free some of its pages (all of them, or only a tail) and
        return their ids. The hooks decide whether the leaf is trimmed, dropped or moved
        to a lower tier, with the tree's surgery API."""

    def added(self, node: TreeNode) -> None:
        """A new node outside the pool (a split of a lower edge, a restored node)."""

    def release(self, node: TreeNode) -> None:
        """A node outside the pool leaves its tier (into the pool, dropped or flushed)."""

    def rekey(self, node: TreeNode) -> None:
        """What a node outside the pool's policy key reads changed (a match or insert
        touched it, a split shortened it): its tier's eviction order follows."""

    def forget(self, nodes: Sequence[TreeNode]) -> None:
        """Flushed nodes: those outside the pool give their slots back."""

    def check(self) -> None:
        """Recount the tiers' own bookkeeping (AssertionError naming the problem)."""

    # -- called by requests (PrefixLease.load) and the step
    def plan_load(self, lower: Sequence[TreeNode], max_tier: Tier = Tier.DISK):
        """The leading nodes of a match's lower part that can come into the pool now,
        locked (a LoadPlan), or None."""

    def load(self, plan, pages: np.ndarray) -> TreeNode:
        """Move a plan's nodes into the pool on `pages`; queue their orders."""

    def cancel(self, plan) -> None:
        """Give up a plan (no pool pages for it)."""

    def take_moves(self) -> list:
        """The orders issued since the last call, in the order they must run."""

    def moves_done(self) -> None:
        """Every order taken so far has run."""
