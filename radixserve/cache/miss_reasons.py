"""Why a prompt was not (all) served from the cache: where its match stopped, and why.

At a request's first admission the engine walks the request's namespace in the radix tree
along its prompt and classifies the point where the match stops:

- `hit`: nothing is missing (every prompt token but the last, which is always computed);
- `diverged`: the cache holds a path that shares a prefix with the prompt and then goes
  on differently (position > 0): the
  first differing token's position and a few tokens of both sides are reported (the
  template-bug finder: a history re-rendered one token differently shows up here);
- `evicted`: the cache held this continuation once: moved to host memory or disk (`tier`
  "host" / "disk": the pool's part stopped there), or dropped (`tier` "dropped");
- `other_namespace`: another namespace of the same tenant (another `cache_salt`) holds a
  longer prefix; never reported across tenants, and never with tokens;
- `never_seen`: none of the above;
- `window_missing`: hybrid models (sliding-window or recurrent layers) whose state for the
  prefix is gone though its full-attention KV is cached: the match backed off to the last
  point whose window is present (the engine's SequenceMemory sets it from the lease's
  `window_short`; `matched_tokens` is what the tree holds, the hit is the usage's).

"Seen once" comes from `SeenPrefixes`: a bounded table of hashes of the prompts' 64-token
prefixes, so `evicted` is told from `never_seen` without keeping any token. Torch-free, and
nothing here changes the tree (no split, no access time, no counters).
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .radix_cache import RadixCache
from .token_keys import ITEM_BYTES, pack, unpack
from .tree_node import TreeNode

SEEN_CHUNK = 64                 # prefixes are remembered at every 64th token
SEEN_LIMIT = 200_000            # remembered prefix hashes (16 bytes each), oldest dropped
CONTEXT = 4                     # tokens shown on each side of a divergence
OTHER_NAMESPACES_CHECKED = 32
CHILDREN_SCANNED = 64           # a divergence's cached side: among this many children
TIER_NAMES = {2: "host", 3: "disk"}


class MissReason(str, enum.Enum):
    HIT = "hit"
    DIVERGED = "diverged"
    EVICTED = "evicted"
    OTHER_NAMESPACE = "other_namespace"
    NEVER_SEEN = "never_seen"
    WINDOW_MISSING = "window_missing"


@dataclass(frozen=True)
class Divergence:
    """The first position where the prompt and a cached path differ, with the tokens of
    both from `start` (a few before the position) to a few after it."""

    position: int
    start: int
    prompt_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]


@dataclass(frozen=True)
class MissReport:
    reason: MissReason
    matched_tokens: int             # prompt tokens the tree holds in any tier
    pool_tokens: int                # of those, in the KV pool
    tier: str | None = None         # evicted: "host", "disk" or "dropped"
    divergence: Divergence | None = None

    def as_dict(self) -> dict:
        out = {"reason": self.reason.value, "matched_tokens": self.matched_tokens,
               "pool_tokens": self.pool_tokens}
        if self.tier is not None:
            out["tier"] = self.tier
        return out


def tenant_of(namespace: str | None) -> str | None:
    """The tenant a namespace belongs to: its key's namespace (`key-...`), else the
    server's one tenant (None)."""
    if namespace is not None and namespace.startswith("key-"):
        return namespace.split("/", 1)[0]
    return None


class SeenPrefixes:
    """Hashes of (namespace, prompt[:chunk * k]) for the prompts admitted so far, bounded
    (`chunk`: 64 tokens in the server; one block's keys in the replay tool)."""

    def __init__(self, limit: int = SEEN_LIMIT, chunk: int = SEEN_CHUNK):
        self.limit = limit
        self.chunk = chunk
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def chain(self, tokens: Sequence[int], namespace: str | None) -> list[bytes]:
        """hash i covers tokens[:chunk * (i + 1)]; each hash folds the one before it."""
        h = hashlib.blake2b(str(namespace).encode(), digest_size=16).digest()
        out = []
        step = self.chunk
        for start in range(0, len(tokens) - step + 1, step):
            chunk = ",".join(map(str, tokens[start:start + step])).encode()
            h = hashlib.blake2b(h + chunk, digest_size=16).digest()
            out.append(h)
        return out

    def knew(self, chain: list[bytes], position: int) -> bool:
        """Was the prefix reaching past `position` (to the next chunk mark) seen?"""
        i = position // self.chunk
        return i < len(chain) and chain[i] in self._seen

    def add(self, chain: list[bytes]) -> None:
        for h in chain:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _closest(node: TreeNode, tokens: Sequence[int], pos: int
             ) -> tuple[TreeNode | None, int, list[int]]:
    """No child starts with the prompt's next page: the child sharing the most of it (the
    most recently used among equals), from the heads of at most 64 children."""
    best, best_n, best_edge = None, -1, []
    for i, child in enumerate(node.children.values()):
        if i == CHILDREN_SCANNED:
            break
        edge = unpack(child.key[:ITEM_BYTES * (len(child.filed_as) // ITEM_BYTES + CONTEXT)])
        n = common_prefix(edge, tokens[pos:pos + len(edge)])
        if n > best_n or (n == best_n and child.last_access > best.last_access):
            best, best_n, best_edge = child, n, edge
    return best, max(best_n, 0), best_edge


def _divergence(tokens: Sequence[int], position: int, node: TreeNode, edge: list[int],
                offset: int) -> Divergence:
    """`edge` (the tokens of `node`'s child edge, starting at prompt position `offset`)
    differs from the prompt at `position`; the cached side before the edge is the prompt
    itself (it matched)."""
    start = max(0, position - CONTEXT)
    end = position - offset + CONTEXT
    if start >= offset:
        cached = edge[start - offset:end]
    else:
        cached = list(tokens[start:offset]) + edge[:end]
    return Divergence(position, start, tuple(tokens[start:position + CONTEXT]), tuple(cached))


def explain(tree: RadixCache, tokens: Sequence[int], namespace: str | None,
            seen: SeenPrefixes | None = None, chain: list[bytes] | None = None) -> MissReport:
    """Where `tokens` stop matching in `namespace`, and why (see the module doc)."""
    limit = len(tokens) - 1
    node = tree.namespace_root(namespace)
    pos = 0
    pool = None                     # where the pool's part ended, when a lower tier follows
    lower_tier = None
    diverged = None
    while node is not None and pos < limit:
        first = tokens[pos:pos + tree.page_size]
        child = node.children.get(pack(first)) if len(first) == tree.page_size else None
        if child is not None:
            edge = child.tokens
            n = common_prefix(edge, tokens[pos:pos + len(edge)])
        else:
            child, n, edge = _closest(node, tokens, pos)
            if child is None:
                break
        if child.tier != 1 and pool is None:
            pool, lower_tier = pos, child.tier
        if n == len(edge):
            pos += n
            node = child
            continue
        if 0 < pos + n < limit:       # nothing in common at all is "never seen"
            diverged = _divergence(tokens, pos + n, node, edge, pos)
        pos += n
        break
    matched = min(pos, limit)
    pool_tokens = matched if pool is None else pool
    if pool is not None:
        return MissReport(MissReason.EVICTED, matched, pool_tokens, TIER_NAMES.get(lower_tier))
    if matched >= limit:
        return MissReport(MissReason.HIT, matched, pool_tokens)
    if diverged is not None:
        return MissReport(MissReason.DIVERGED, matched, pool_tokens, divergence=diverged)
    if seen is not None and seen.knew(chain if chain is not None
                                      else seen.chain(tokens, namespace), matched):
        return MissReport(MissReason.EVICTED, matched, pool_tokens, "dropped")
    tenant = tenant_of(namespace)
    others = [ns for ns in tree.namespaces() if ns != namespace and tenant_of(ns) == tenant]
    for other in others[:OTHER_NAMESPACES_CHECKED]:
        if tree.peek_prefix(tokens, other, max_tokens=limit) > matched:
            return MissReport(MissReason.OTHER_NAMESPACE, matched, pool_tokens)
    return MissReport(MissReason.NEVER_SEEN, matched, pool_tokens)
