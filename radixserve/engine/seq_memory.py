"""SequenceMemory: the one place where sequences take, share and give back KV pages.

Every page a sequence holds is either a tree page (alive because the sequence locks the
tree node that ends its cached prefix) or a private page (owned by the sequence alone).
`release` is the single exit: finish, abort, preemption and step errors all go through
it, so a page is returned exactly once whatever path a request takes.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from radixserve.cache.memory import PagedMemory
from radixserve.cache.radix_cache import RadixCache
from radixserve.engine.request import NO_PAGES, SeqState

LOOKAHEAD_TOKENS = 8    # decode pages taken ahead while memory is plentiful


class SequenceMemory:
    def __init__(self, memory: PagedMemory, tree: RadixCache, page_size: int,
                 use_cache: bool, copy_prefix: Callable[[int, int, int], None]):
        self.memory = memory
        self.tree = tree
        self.page_size = page_size
        self.use_cache = use_cache
        self.copy_prefix = copy_prefix
        self.lookahead_pages = LOOKAHEAD_TOKENS // page_size
        self.lookahead_floor = memory.allocator.num_pages // 4

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def cached_prefix_len(self, seq: SeqState) -> int:
        """How much of the sequence the tree holds now (for scheduling priority)."""
        if not self.use_cache:
            return 0
        return self.tree.peek_prefix(seq.token_ids, seq.request.namespace,
                                     max_tokens=len(seq.token_ids) - 1)

    def admit(self, seq: SeqState) -> int:
        """Match and lock the cached prefix; copy a partially matched page (copy-on-write).

        Returns the number of tokens served from the cache. Raises OutOfPages (with the
        lock released) when not even the copy-on-write page can be had.
        """
        assert seq.lock_node is None and seq.pages.size == 0
        if not self.use_cache:
            return 0
        match = self.tree.match_prefix(seq.token_ids, seq.request.namespace,
                                       max_tokens=len(seq.token_ids) - 1)
        self.tree.lock(match.node)
        seq.lock_node = match.node
        seq.pages = match.pages
        seq.tree_len = len(match.pages) * self.page_size
        seq.num_computed = seq.tree_len
        if match.cow_tokens > 0:
            try:
                (page,) = self.memory.alloc(1)
            except Exception:
                self.release(seq, keep=False)
                raise
            self.copy_prefix(match.cow_page, int(page), match.cow_tokens)
            seq.pages = np.append(seq.pages, np.int32(page))
            seq.num_computed += match.cow_tokens
        return seq.num_computed

    def reserve(self, seq: SeqState, new_tokens: int) -> None:
        """Make the page table cover `new_tokens` more tokens (raises OutOfPages).

        While a quarter of the pool is free, small pages are taken a few tokens ahead, so a
        decoding sequence grows its page table every 8th step rather than every step.
        """
        missing = self.pages_for(seq.num_computed + new_tokens) - len(seq.pages)
        if missing <= 0:
            return
        allocator = self.memory.allocator
        if allocator.num_free > self.lookahead_floor:
            missing += self.lookahead_pages
        seq.pages = np.concatenate([seq.pages, self.memory.alloc(missing)])

    def commit(self, seq: SeqState) -> None:
        """Insert the computed whole pages into the tree and adopt the tree's pages."""
        if not self.use_cache:
            return
        full = seq.num_computed // self.page_size
        if full * self.page_size <= seq.tree_len:
            return
        result = self.tree.insert(seq.token_ids[: full * self.page_size], seq.pages[:full],
                                  seq.request.namespace, start=seq.lock_node)
        duplicates = seq.pages[seq.num_tree_pages: result.cached_tokens // self.page_size]
        if duplicates.size:
            self.memory.allocator.free(duplicates)
        seq.pages = np.concatenate([result.pages, seq.pages[full:]])
        self.tree.lock(result.node)
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
        seq.lock_node = result.node
        seq.tree_len = full * self.page_size

    def release(self, seq: SeqState, keep: bool) -> None:
        """Give back everything the sequence holds; `keep` first caches its computed KV."""
        if keep:
            self.commit(seq)
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
        private = seq.private_pages
        if private.size:
            self.memory.allocator.free(private)
        seq.pages = NO_PAGES
        seq.tree_len = 0
        seq.lock_node = None
        seq.num_computed = 0

    def check(self, live: Iterable[SeqState]) -> None:
        """Page conservation: free + tree + private pages of live sequences == total."""
        self.memory.check_conservation([s.private_pages for s in live])
        self.tree.check_invariants()
