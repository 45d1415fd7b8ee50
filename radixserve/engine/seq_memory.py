"""SequenceMemory: the engine's sequences and their prefix leases.

Each admitted sequence holds one `PrefixLease` (cache/prefix_lease.py), which does every
page step: match and lock, copy-on-write, insert, free duplicates, release. This module
adds only what is the engine's own: page look-ahead for decoding, the sequence fields that
mirror the lease, and `release` as the single exit -- finish, abort, preemption and step
errors all go through it, so a page is returned exactly once whatever path a request takes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterable

from radixserve.cache.memory import PagedMemory
from radixserve.cache.miss_reasons import MissReason, MissReport, SeenPrefixes, explain
from radixserve.cache.tiers import ReadPending
from radixserve.cache.window_lease import new_lease
from radixserve.cache.window_memory import WindowedMemory
from radixserve.engine.request import SeqState

if TYPE_CHECKING:
    from radixserve.engine.peer_share import PeerOrders, PeerShare
    from radixserve.engine.tier_runtime import TierRuntime

LOOKAHEAD_TOKENS = 8    # decode pages taken ahead while memory is plentiful


class SequenceMemory:
    def __init__(self, memory: PagedMemory, use_cache: bool,
                 tiers: TierRuntime | None = None, peers: PeerShare | None = None):
        self.pool = memory         # the KV pool's pages and the tree (PagedMemory)
        self.tiers = tiers          # host/disk tiers: what loads a match's lower part
        self.peers = peers          # --kv-share: the cluster store below them
        self.tree = memory.tree
        self.page_size = memory.page_size
        self.use_cache = use_cache
        self.lookahead_pages = LOOKAHEAD_TOKENS // self.page_size
        self.lookahead_floor = memory.num_pages // 4
        self.seen = SeenPrefixes()
        # Hybrid models (per-group pools): leases that hold windowed KV only where needed.
        self._windowed = isinstance(memory, WindowedMemory)

    def explain_miss(self, seq: SeqState) -> MissReport | None:
        """Where the prompt stops matching in the tree and why (cache/miss_reasons.py); then
        the prompt is remembered as seen. None without the cache."""
        if not self.use_cache:
            return None
        prompt = seq.request.prompt_ids
        chain = self.seen.chain(prompt, seq.request.namespace)
        report = explain(self.tree, prompt, seq.request.namespace, self.seen, chain)
        self.seen.add(chain)
        if self._windowed and seq.lease is not None and seq.lease.window_short:
            report = replace(report, reason=MissReason.WINDOW_MISSING)
        return report

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def available_pages(self) -> int:
        """Pages an allocation could get now: free + evictable (see PagedMemory)."""
        return self.pool.available_pages()

    def evict_ahead(self, num_seqs: int) -> None:
        """Before `num_seqs` running sequences each grow by a token: evict once for the
        pages they will need (PagedMemory.evict_ahead), not once per sequence."""
        self.pool.evict_ahead(-(-num_seqs // self.page_size))

    def cached_prefix_len(self, seq: SeqState) -> int:
        """How much of the sequence the tree holds now (for scheduling priority)."""
        if not self.use_cache:
            return 0
        return self.tree.peek_prefix(seq.token_ids, seq.request.namespace,
                                     max_tokens=len(seq.token_ids) - 1)

    def admit(self, seq: SeqState, reuse_cache: bool = True) -> int:
        """Lease the cached prefix; returns the tokens served from the cache.

        Takes no page: a copy-on-write page comes with the first `reserve`. Without
        `reuse_cache` the lease matches nothing (its pages are still inserted after
        computing): the scheduler's way out when the hit itself blocks admission. With tiers, the
        part of the prefix in host memory / on disk is loaded into pool pages (LoadOrders
        for the next step) when `costs` say loading beats computing it. Raises ReadPending
        (nothing held) while disk pages it would load are being read off this thread, or
        while the cluster store is asked about the rest (--kv-share: engine/peer_share.py).
        """
        assert seq.lease is None
        if self.peers is not None and self.peers.pending(seq):
            raise ReadPending           # the cluster store is being asked: nothing taken
        lease = new_lease(self.pool, seq.request.namespace, self.use_cache)
        match = lease.acquire(seq.token_ids,
                              max_tokens=len(seq.token_ids) - 1 if reuse_cache else 0)
        seq.lease = lease
        if match is not None and match.lower and self.tiers is not None:
            try:
                self.tiers.load(lease, match)
            except ReadPending:         # its disk pages are being read: admit it later
                self.release(seq, keep=False)
                raise
        if match is not None and reuse_cache and self.peers is not None:
            try:
                self.peers.load(lease, seq)
            except ReadPending:         # asked off this thread, or a peer computes it
                self.release(seq, keep=False)
                raise
        seq.num_computed = lease.matched_tokens
        return seq.num_computed

    def take_moves(self) -> list:
        """Tier moves issued since the last call, for the next step (in this order)."""
        return self.tiers.take_moves() if self.tiers is not None else []

    def take_peer_orders(self) -> PeerOrders | None:
        """--kv-share: pages to publish and peer pages to write in, for the next step."""
        return self.peers.take_orders() if self.peers is not None else None

    def has_orders(self) -> bool:
        """Orders waiting for a step even when no sequence is (pages to publish)."""
        return self.peers is not None and self.peers.has_orders()

    def moves_done(self) -> None:
        if self.tiers is not None:
            self.tiers.moves_done()

    def reserve(self, seq: SeqState, new_tokens: int) -> None:
        """Make the page table cover `new_tokens` more tokens (raises OutOfPages).

        While a quarter of the pool is free, small pages are taken a few tokens ahead, so a
        decoding sequence grows its page table every 8th step rather than every step.
        """
        lease = seq.lease           # (inlined pages_for: this runs for every span of every step)
        if self._windowed:
            lease.slide(seq.num_computed)
        missing = -(-(seq.num_computed + new_tokens) // self.page_size) - len(lease.pages)
        if missing <= 0:
            return
        if self.pool.num_free > self.lookahead_floor:
            missing += self.lookahead_pages
        lease.grow(missing)

    def commit(self, seq: SeqState) -> None:
        """Insert the computed whole pages into the tree (the lease adopts the tree's)."""
        seq.lease.extend(seq.token_ids, seq.num_computed)
        if self.peers is not None and not seq.shared and self.use_cache:
            if seq.num_computed // self.page_size >= (seq.prompt_len - 1) // self.page_size:
                seq.shared = True   # every page a later request could load is computed
                self.peers.publish(seq)
            else:
                self.peers.progress(seq)    # its claims outlive a slow prefill

    def release(self, seq: SeqState, keep: bool) -> None:
        """Give back everything the sequence holds; `keep` first caches its computed KV."""
        lease = seq.lease
        if lease is not None:
            if keep:
                lease.release(seq.token_ids, seq.num_computed)
            else:
                lease.release()
        seq.lease = None
        seq.num_computed = 0

    def retire(self, seq: SeqState, keep: bool) -> None:
        """The sequence's last release (finished, aborted, failed): also its store claims."""
        self.release(seq, keep)
        if self.peers is not None:
            self.peers.retire(seq)

    def check(self, live: Iterable[SeqState]) -> None:
        """Page conservation: free + tree + private pages of live sequences == total."""
        self.pool.check_conservation([s.private_pages for s in live])
        self.tree.check_invariants()
