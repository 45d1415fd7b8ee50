"""AdaptivePolicy: evict the leaf least likely to be reused soon, with odds learned online.

Why not LRU
-----------
LRU gives every leaf the same lifetime after its last use. Prefix-cache traffic mixes leaves
whose odds of being used again differ by an order of magnitude: a shared document used by
many requests, a conversation's newest turn that its next turn will extend, the unique
question after a shared document that no request repeats. This policy sorts leaves into a
few *classes* by what the server knows when it keys them, learns each class's reuse odds
from the cache's own hits, and moves each leaf's eviction time by them:

    key = last_access + horizon * logit(p(class))       (smallest key is evicted first)

This is the lifetime rule of a TTL cache that keeps an item while its chance of being hit
per unit of space stays above a common threshold (for a class that is reused with
probability p after a typical gap `horizon`, the lifetime grows like horizon * logit(p); the
threshold is a shift common to all leaves, so it drops out of the ordering). With every p
equal it is exactly LRU. Content that has been reused is never evicted *before* LRU would
evict it (its bonus is at least 0); content seen once can be evicted sooner.

Classes (what a live server knows when the leaf is keyed)
---------------------------------------------------------
- uses: how often this content has been used -- its creation, its hits, and earlier
  incarnations: a *ghost* table (as in ARC and S3-FIFO) remembers leaves after they are
  evicted, by a fingerprint of their end (namespace, depth, last tokens), so a request that
  brings evicted content back counts as its second use. 1, 2, or 3 and more;
- for content used once: whether it hangs under a cached prefix (a conversation's next
  turn, a question after a shared document) or starts at the root (new traffic), and its
  size in tokens (in powers of 4: on the Mooncake trace a new one-block prompt is almost
  never reused, a new 50-block document two times in three).

Online learning, without feedback
---------------------------------
A leaf's wait for its next use (from its creation or its last hit) is a *trial* of its
class; its next hit is a success. A node used only as the inner node of longer prefixes,
which is a leaf again because they were evicted (a finished conversation's history), was
not itself what the traffic came back for: its trial is withdrawn, not a success (it is
keyed then with an older `last_access` than the newest the policy has seen). If the odds were learned from every leaf, a class judged
poor would be evicted early, rarely hit, and judged poorer still. So, as in set dueling
(DIP, DRRIP), one leaf in `explore` (by node id) is an *explorer*: keyed class-blind, with
the mean odds of all classes, and only explorers' trials teach the odds. p(class) =
(successes + 1) / (trials + 2), both decayed by `1 - 1/window` per trial, so the odds follow
the traffic. `horizon` is the mean clock gap from an explorer's trial start to its success:
hits happen only within the cache's residence time, so it follows the capacity and the load.
Nothing is tuned for one trace.

Admission (`admission=True`, the default): a leaf whose class has odds below
`admission_threshold` (a request's unique tail with no reuse signal) gets a key below every
other leaf's: the tree never keeps it at the expense of anything with a reuse signal. It
still fills free pages, which costs nothing.

Cost and the policy interface
-----------------------------
O(1) work per `key` call (dict lookups), so the cache's operations stay O(log n). The cache
may recompute a key at any time (`check_invariants`) and expects the same answer until the
leaf's fields change; this key depends on odds learned later, so the policy memoizes each
node's key with the node fields it came from (`_Entry`) and returns it while they are
unchanged. Entries of nodes that left the tree go in an amortized sweep of the memo (never
of the tree); the ghost table holds at most `ghost_factor` entries per memoized node.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .eviction import EvictionPolicy
from .tree_node import TreeNode

__all__ = ["AdaptivePolicy", "CLASS_NAMES"]

_FP_BYTES = 64             # fingerprint: the sequence's last 8 token ids, with its depth

SEEN_TWICE, SEEN_OFTEN = 0, 1
_SIZE_BUCKETS = 9          # new content by size: < 4 tokens, < 16, < 64, ..., >= 4**8 = 64Ki
CLASS_NAMES = ("used twice", "used 3+ times") + tuple(
    f"new {where}, {'<' if b < _SIZE_BUCKETS - 1 else '>='} {4 ** (b + 1 if b < _SIZE_BUCKETS - 1 else b)} tokens"
    for b in range(_SIZE_BUCKETS) for where in ("at root", "under a prefix"))
_NUM_CLASSES = len(CLASS_NAMES)
_MAX_ODDS = 0.999
_NOT_ADMITTED = 1e15       # subtracted from the key of a leaf that is not admitted


@dataclass(slots=True)
class _Entry:
    """What the policy decided for one node, and the node fields it decided from."""

    node: TreeNode
    last_access: int
    hit_count: int
    num_tokens: int
    uses: int              # uses of this content so far (incarnations + hits)
    cls: int
    trial_start: int       # clock at the start of the open trial
    explorer: bool         # keyed class-blind; only explorers teach the odds
    key: float = 0.0


class AdaptivePolicy(EvictionPolicy):
    """Per-class reuse odds, learned online, stretch or shrink LRU's lifetime."""

    name = "adaptive"
    key_is_stable = False  # key() learns (trials, its clock) each time it is asked
    tokens_per_key = 1.0   # the replay's block mode sets it: a tree key there is not a token

    def __init__(self, window: int = 1024, explore: int = 8, admission: bool = True,
                 admission_threshold: float = 0.05, ghost_factor: int = 4):
        if window < 2:
            raise ValueError("window must be >= 2")
        if explore < 1:
            raise ValueError("explore must be >= 1 (1: every leaf is an explorer)")
        if not 0.0 <= admission_threshold < 1.0:
            raise ValueError("admission_threshold must be in [0, 1)")
        if ghost_factor < 0:
            raise ValueError("ghost_factor must be >= 0")
        self.window = window
        self.explore = explore
        self.admission = admission
        self.admission_threshold = admission_threshold
        self.ghost_factor = ghost_factor
        self.trials = [0.0] * _NUM_CLASSES
        self.successes = [0.0] * _NUM_CLASSES
        self._gap_sum = 0.0           # decayed sum and count of success gaps (clock ticks)
        self._gap_count = 0.0
        self._memo: dict[int, _Entry] = {}
        self._memo_swept = 0          # memo size after the last sweep
        self._ghost: OrderedDict[tuple, int] = OrderedDict()   # fingerprint -> uses
        self._now = 0                 # the newest last_access keyed so far

    # ------------------------------------------------------------------ learned state
    def odds(self, cls: int) -> float:
        """Estimated chance that a leaf of this class is used again while cached."""
        return min((self.successes[cls] + 1.0) / (self.trials[cls] + 2.0), _MAX_ODDS)

    def mean_odds(self) -> float:
        """The class-blind odds: what explorers are keyed with."""
        return min((sum(self.successes) + 1.0) / (sum(self.trials) + 2.0), _MAX_ODDS)

    @property
    def horizon(self) -> float:
        """Mean clock ticks from a trial's start to its success (1 before any success)."""
        return self._gap_sum / self._gap_count if self._gap_count else 1.0

    def class_of(self, node: TreeNode) -> str | None:
        """The class the policy last put this node in (None: never keyed)."""
        entry = self._memo.get(node.id)
        return CLASS_NAMES[entry.cls] if entry is not None and entry.node is node else None

    def stats(self) -> dict:
        """The learned state, for reports and tests."""
        return {"horizon": self.horizon, "mean_odds": self.mean_odds(),
                "odds": {n: self.odds(c) for c, n in enumerate(CLASS_NAMES)},
                "trials": {n: self.trials[c] for c, n in enumerate(CLASS_NAMES)}}

    def _open_trial(self, cls: int) -> None:
        decay = 1.0 - 1.0 / self.window
        for c in range(_NUM_CLASSES):
            self.trials[c] *= decay
            self.successes[c] *= decay
        self.trials[cls] += 1.0

    def _close_trial(self, entry: _Entry, now: int, fresh: bool) -> None:
        """A success when the leaf itself was hit; withdrawn when it was used as an inner
        node of longer prefixes and is a leaf again only because they were evicted."""
        if not fresh:
            self.trials[entry.cls] = max(self.trials[entry.cls] - 1.0, 0.0)
            return
        self.successes[entry.cls] += 1.0
        decay = 1.0 - 1.0 / self.window
        self._gap_sum = self._gap_sum * decay + (now - entry.trial_start)
        self._gap_count = self._gap_count * decay + 1.0

    # ------------------------------------------------------------------ the key
    def key(self, node: TreeNode) -> Any:
        fresh = node.last_access >= self._now     # keyed at the moment of its last use
        if node.last_access > self._now:
            self._now = node.last_access
        entry = self._memo.get(node.id)
        if entry is not None and entry.node is node and entry.last_access == node.last_access \
                and entry.hit_count == node.hit_count and entry.num_tokens == node.num_tokens:
            return entry.key                      # nothing changed: the same answer
        fp = _fingerprint(node)
        if entry is None or entry.node is not node:
            entry = self._first_sighting(node, fp)
        elif node.hit_count > entry.hit_count:    # used since it was keyed
            if entry.explorer:
                self._close_trial(entry, node.last_access, fresh)
            entry.uses += node.hit_count - entry.hit_count
            entry.cls = _classify(node, entry.uses, entry.num_tokens * self.tokens_per_key)
            entry.trial_start = node.last_access
            if entry.explorer:
                self._open_trial(entry.cls)
        entry.last_access = node.last_access
        entry.hit_count = node.hit_count
        entry.num_tokens = node.num_tokens
        self._remember(fp, entry.uses)
        entry.key = self._score(node, entry)
        return entry.key

    def _first_sighting(self, node: TreeNode, fp: tuple) -> _Entry:
        """A fresh leaf (used once, or more if the ghost table knows its content), or an
        inner node that has just become a leaf."""
        uses = max(self._ghost.pop(fp, 0), node.hit_count) + 1
        cls = _classify(node, uses, node.num_tokens * self.tokens_per_key)
        explorer = (node.id * 2654435761) % self.explore == 0     # a fixed spread of ids
        if explorer:
            self._open_trial(cls)
        entry = _Entry(node, node.last_access, node.hit_count, node.num_tokens, uses, cls,
                       node.last_access, explorer)
        self._memo[node.id] = entry
        self._maybe_sweep()
        return entry

    def _score(self, node: TreeNode, entry: _Entry) -> float:
        p = self.mean_odds() if entry.explorer else self.odds(entry.cls)
        bonus = math.log(p / (1.0 - p))
        if entry.cls <= SEEN_OFTEN:
            bonus = max(bonus, 0.0)               # reused content: never before LRU would
        key = node.last_access + self.horizon * bonus
        if self.admission and not entry.explorer and p < self.admission_threshold:
            key -= _NOT_ADMITTED
        return key

    # ------------------------------------------------------------------ bookkeeping
    def _remember(self, fp: tuple, uses: int) -> None:
        ghost = self._ghost
        ghost[fp] = uses
        ghost.move_to_end(fp)
        limit = self.ghost_factor * max(len(self._memo), 1024)
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def _maybe_sweep(self) -> None:
        """Drop memo entries of nodes that left the tree; amortized O(1) per new entry."""
        if len(self._memo) <= 2 * self._memo_swept + 4096:
            return
        self._memo = {i: e for i, e in self._memo.items() if e.node.parent is not None}
        self._memo_swept = len(self._memo)


def _fingerprint(node: TreeNode) -> tuple:
    """Names the content a leaf ends with, wherever its edge starts: namespace, depth and
    the sequence's last 8 token ids (from the parents when the edge is shorter)."""
    tail = node.key[-_FP_BYTES:]
    parent = node.parent
    while len(tail) < _FP_BYTES and parent is not None and parent.depth:
        tail = parent.key[len(tail) - _FP_BYTES:] + tail
        parent = parent.parent
    return node.namespace, node.depth, tail


def _classify(node: TreeNode, uses: int, tokens: float) -> int:
    """The leaf's class; `tokens`: its edge's size in tokens (for new content only)."""
    if uses >= 3:
        return SEEN_OFTEN
    if uses == 2:
        return SEEN_TWICE
    bucket = min(int(math.log2(max(tokens, 1))) // 2, _SIZE_BUCKETS - 1)
    return 2 + 2 * bucket + (node.depth > node.num_tokens)
