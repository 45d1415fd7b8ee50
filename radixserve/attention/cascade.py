"""Which sequences of a step share a KV prefix: the grouping half of cascade attention.

The radix cache hands every request with the same system prompt the *same physical pages*,
so in one step many sequences' page arrays start with identical page ids. Attention over
such a shared prefix can be computed once per group (one gather, one large matmul over all
members' queries) instead of once per sequence; the backend then merges it with each
sequence's attention over the rest of its context (see ``partial_attention``).

A group's shared prefix is a whole number of pages that every member has entirely *before*
its new tokens (``shared_tokens <= cached_len``), so every new query sees all of it and the
shared part needs no mask.

Grouping is a greedy pass over the trie of page arrays (pure numpy, once per step):
at a trie node whose rows agree on their first ``L`` pages, each child subtree (rows that also
agree on page ``L``) is solved recursively; a child keeps its own, deeper groups when they save
more page reads than its grouped rows would add by sharing ``L`` pages here, otherwise its rows
join this node's pool. The pool becomes a group of length ``L`` when it has >= 2 rows and ``L``
reaches the threshold. "Page reads saved" by a group of ``m`` rows sharing ``L`` pages is
``(m - 1) * L``. So 64 requests that share a 20-token chat header and then split into 8
system prompts of 1,000 tokens form 8 groups of 1,000 tokens, not one group of 20.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Deeper trie levels are not split further (they join the pool at that level): bounds the
# recursion on pathological inputs such as many nested prefixes of one conversation.
MAX_TRIE_DEPTH = 64


@dataclass(frozen=True, slots=True)
class CascadeGroup:
    """Spans (indices into the step) whose first ``shared_pages`` page ids are identical."""

    members: tuple[int, ...]     # ascending span indices, >= 2 of them
    shared_pages: int
    shared_tokens: int           # shared_pages * page_size, <= every member's cached_len


def find_cascade_groups(pages: Sequence[np.ndarray], cached_lens: Sequence[int],
                        page_size: int, min_shared_tokens: int) -> list[CascadeGroup]:
    """Disjoint groups of spans sharing >= ``min_shared_tokens`` leading tokens' pages.

    ``pages[b]`` are span b's page ids (at least ``cached_len // page_size`` of them);
    only its first ``cached_len // page_size`` pages (whole pages of cached tokens) can be
    shared. Groups come ordered by their smallest member.
    """
    min_pages = max(1, -(-min_shared_tokens // page_size))
    caps = np.asarray(cached_lens, dtype=np.int64) // page_size
    rows = _candidates(pages, caps, min_pages)
    if len(rows) < 2:
        return []
    table = _page_table(pages, caps, rows)
    _, found, _ = _solve(table, np.arange(len(rows)), 0, min_pages, 0)
    result = [CascadeGroup(members=tuple(sorted(int(rows[i]) for i in members)),
                           shared_pages=length, shared_tokens=length * page_size)
              for members, length in found]
    return sorted(result, key=lambda g: g.members[0])


def _candidates(pages: Sequence[np.ndarray], caps: np.ndarray, min_pages: int) -> np.ndarray:
    """Spans with enough whole cached pages whose first page some other candidate has too."""
    rows = np.flatnonzero(caps >= min_pages)
    if len(rows) < 2:
        return rows
    first = np.fromiter((pages[b][0] for b in rows), dtype=np.int64, count=len(rows))
    _, inverse, counts = np.unique(first, return_inverse=True, return_counts=True)
    return rows[counts[inverse] >= 2]


def _page_table(pages: Sequence[np.ndarray], caps: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[len(rows), max cap] page ids; past a row's cap a negative value unique to the row,
    so no two rows ever agree beyond the shorter one's shareable pages."""
    width = int(caps[rows].max())
    table = np.broadcast_to(-1 - np.arange(len(rows), dtype=np.int64)[:, None],
                            (len(rows), width)).copy()
    for i, b in enumerate(rows):
        table[i, :caps[b]] = pages[b][:caps[b]]
    return table


def _common_prefix(block: np.ndarray) -> int:
    """Columns on which all rows agree, from the left. Gallops so that rows differing early
    (the usual case) cost O(rows), not O(rows * width)."""
    width = block.shape[1]
    done, step = 0, 1
    while done < width:
        part = block[:, done:done + step]
        agree = (part == part[0]).all(axis=0)
        if not agree.all():
            return done + int(np.argmin(agree))
        done += part.shape[1]
        step *= 2
    return width


def _solve(table: np.ndarray, rows: np.ndarray, known: int, min_pages: int,
           depth: int) -> tuple[int, list[tuple[np.ndarray, int]], np.ndarray]:
    """Best greedy grouping of ``rows`` (which agree on their first ``known`` columns).

    Returns (page reads saved, groups as (rows, shared pages), rows left in no group).
    """
    length = known + _common_prefix(table[rows, known:])
    saved, groups, pool = 0, [], [rows[:0]]
    if length < table.shape[1] and depth < MAX_TRIE_DEPTH:
        keys = table[rows, length]
        for key in np.unique(keys):
            child = rows[keys == key]
            if len(child) < 2:
                pool.append(child)
                continue
            c_saved, c_groups, c_left = _solve(table, child, length + 1, min_pages, depth + 1)
            grouped = len(child) - len(c_left)
            if c_saved > grouped * length:       # deeper groups beat sharing `length` here
                saved += c_saved
                groups.extend(c_groups)
                pool.append(c_left)
            else:
                pool.append(child)
    else:
        pool.append(rows)
    pooled = np.concatenate(pool)
    if len(pooled) >= 2 and length >= min_pages:
        return saved + (len(pooled) - 1) * length, groups + [(pooled, length)], rows[:0]
    return saved, groups, pooled
