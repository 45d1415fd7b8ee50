"""Eviction policies: which unlocked leaf of the radix tree goes first.

The interface
-------------
A policy is an object with a `name` and one method, `key(node) -> comparable`. The cache keeps
its evictable leaves (unlocked nodes without children) in a heap (eviction_queue.py)
ordered by `(policy.key(node), node.id)` and evicts from the small end, so:

- smaller key = evicted first; equal keys break by node id (older node first), so every
  policy is deterministic;
- the key may read only the node's fields: `id`, `last_access` (the cache's logical clock:
  an int bumped once per match/insert/evict, never wall time), `hit_count` (match_prefix
  calls that used the node), `num_tokens`, `depth` (tokens from the namespace root to the
  end of the edge), `key` (the edge's token ids, packed: see token_keys.py), `namespace` -- plus the policy's own state;
- the cache computes the key when a leaf becomes evictable (created, unlocked, or its last
  child evicted) and recomputes it when the leaf is accessed (match/insert), split or
  trimmed. Between those events the key must not change (`check_invariants` recomputes it),
  so a policy must not depend on "now". Aging is therefore expressed as a bonus that grows
  with `last_access` (log-domain decay), not as a penalty that grows with time.

The offline replay tool plugs in Belady (next use farthest first) the same way: its `key`
returns minus the position of the node's next use in the trace, which only changes when
the node is used, i.e. exactly when the cache re-keys it.

Policies here: "lru" (default), "lfu" (frequency with exponential aging) and "gdsf"
(frequency x recompute cost per cached token, with the same aging); "adaptive" lives in
adaptive_policy.py (reuse odds per class of leaf, learned online; its key depends on what it
learned later, so it memoizes each node's key with the fields it was computed from).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

from .tree_node import TreeNode

__all__ = ["EvictionPolicy", "LRUPolicy", "LFUPolicy", "GDSFPolicy", "POLICIES", "make_policy"]


class EvictionPolicy(ABC):
    name: str = "custom"
    # Does `key` read the edge's length (num_tokens, depth, key)? If not, trimming a
    # leaf's tail on eviction cannot move it in the queue, and the cache skips the re-key.
    key_reads_size: bool = True
    # Is `key` a plain function of the node's fields, changing only when the tree touches,
    # splits or trims the node? Then the lower tiers keep their nodes in a queue
    # (cache/tier_queue.py); if not (it learns as it is asked, or reads the clock of an
    # offline replay), they sort their nodes with fresh keys each time they make room.
    key_is_stable: bool = True

    @abstractmethod
    def key(self, node: TreeNode) -> Any:
        """Sort key of an evictable leaf: the smallest is evicted first."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"
    key_reads_size = False

    def key(self, node: TreeNode) -> Any:
        return node.last_access


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, with aging so that yesterday's hot prefix does not stay.

    Score = hits * 2 ** -(age / half_life), age = operations since the last access. Ranking by
    log2 of it and dropping the common `now / half_life` term gives a key that does not
    change until the node is touched again: log2(1 + hits) + last_access / half_life.
    """

    name = "lfu"
    key_reads_size = False

    def __init__(self, half_life: int = 4096):
        if half_life <= 0:
            raise ValueError("half_life must be > 0")
        self.half_life = half_life

    def key(self, node: TreeNode) -> Any:
        return math.log2(1 + node.hit_count) + node.last_access / self.half_life


class GDSFPolicy(LFUPolicy):
    """Greedy-Dual-Size-Frequency for KV: keep what is costly to recompute per page it holds.

    Value per cached token = frequency x recompute cost per token. Recomputing a token at
    position p costs about 1 + p / attention_tokens (the MLP part is constant, attention
    grows with the context), so deep tails of long prefixes are worth more per page than
    short ones with the same hits. Same log-domain aging as LFU.
    """

    name = "gdsf"
    key_reads_size = True

    def __init__(self, half_life: int = 4096, attention_tokens: int = 4096):
        super().__init__(half_life)
        if attention_tokens <= 0:
            raise ValueError("attention_tokens must be > 0")
        self.attention_tokens = attention_tokens

    def key(self, node: TreeNode) -> Any:
        n = node.num_tokens
        mean_position = node.depth - (n + 1) / 2
        cost_per_token = 1.0 + mean_position / self.attention_tokens
        return (math.log2((1 + node.hit_count) * cost_per_token)
                + node.last_access / self.half_life)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy,
                                              "gdsf": GDSFPolicy}


def _register_adaptive() -> None:
    # Imported here: adaptive_policy.py subclasses EvictionPolicy from this module.
    from .adaptive_policy import AdaptivePolicy

    POLICIES[AdaptivePolicy.name] = AdaptivePolicy


_register_adaptive()


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy by name, or the given object with a `key(node)` method (duck-typed)."""
    if not isinstance(policy, str):
        if not callable(getattr(policy, "key", None)):
            raise TypeError(f"an eviction policy needs a key(node) method, got {policy!r}")
        return policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {policy!r}; "
                         f"choose from {sorted(POLICIES)}") from None
