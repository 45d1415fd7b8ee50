"""The window-aware radix cache without a model: WindowRule's match points, a running
request's windowed pages sliding out, eviction dropping windows before full pages, and a
hypothesis state machine (both pools conserved after every step; every match point it
reports has its window present)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixserve.cache.page_allocator import OutOfPages
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.window_lease import WindowedLease
from radixserve.cache.window_memory import WindowedMemory
from radixserve.cache.window_rule import WindowRule


def make_memory(full_pages: int, window_pages: int, window: int = 8, page_size: int = 2,
                checkpoint: int = 16) -> WindowedMemory:
    rule = WindowRule(window, page_size, checkpoint)
    return WindowedMemory(full_pages, RadixCache(page_size), window_pages, rule)


def window_present(mem: WindowedMemory, lease: WindowedLease) -> bool:
    """The window [m - W, m) of the lease's match point m is held (cow page included)."""
    m = lease.matched_tokens
    lo, hi = mem.rule.needed_pages(m)
    pages = list(lease.pages[lo:hi])
    if lease._cow is not None:
        pages.append(lease._cow[0])
    return bool(mem.windows.present(np.asarray(pages, dtype=np.int64)).all())


def run_request(mem: WindowedMemory, tokens: list[int], chunk: int = 8, keep: bool = True,
                use_cache: bool = True, on_step=None) -> WindowedLease:
    """One request as the engine runs it: match, then grow / compute / extend per chunk."""
    lease = WindowedLease(mem, None, use_cache)
    lease.acquire(tokens, max_tokens=len(tokens) - 1)
    n = lease.matched_tokens
    ps = mem.page_size
    try:
        while n < len(tokens):
            step = min(chunk, len(tokens) - n)
            lease.slide(n)
            lease.grow(-(-(n + step) // ps) - len(lease.pages))
            n += step
            lease.extend(tokens, n)
            if on_step is not None:
                on_step(lease, n)
    except OutOfPages:
        lease.release()
        return lease
    lease.release(tokens if keep else None, n)
    return lease


def test_usable_point_backs_off_to_the_last_present_window():
    rule = WindowRule(window=4, page_size=2, checkpoint=8)
    present = np.array([True, True, True, True, False, True, True, True])  # page 4 missing
    assert rule.usable_point(present, 16) == 16     # needs pages 6..7 only
    present[6] = False
    assert rule.usable_point(present, 16) == 8      # 14 needs page 6; 12 and 10 page 4
    assert rule.usable_point(present, 9) == 8       # 8 needs pages 2..3
    assert rule.usable_point(np.zeros(3, bool), 6) == 0
    # Inside a page (copy-on-write): the partial page's window counts too.
    assert rule.usable_point(np.array([True, True, False]), 5) == 4


def test_kept_pages_are_the_match_points_windows():
    rule = WindowRule(window=4, page_size=2, checkpoint=16)
    kept = rule.kept(np.arange(16), branch=22)
    # first window [0, 4), checkpoints 16's [12, 16) and 32's [28, 32), the branch's [18, 22)
    assert np.flatnonzero(kept).tolist() == [0, 1, 6, 7, 9, 10, 14, 15]


def test_a_long_request_holds_its_window_plus_a_page():
    """32k tokens at W=512: the request's own windowed pages stay within its window, one
    page and its look-ahead, cache on (checkpoints go to the tree) or off."""
    ps, w = 16, 512
    for use_cache in (True, False):
        mem = make_memory(2100, 400, window=w, page_size=ps, checkpoint=8 * w)
        held = []

        def check(lease: WindowedLease, n: int) -> None:
            private = lease.pages[lease.num_tree_pages:]
            held.append(int(mem.windows.present(private).sum()))

        tokens = list(range(32768))
        run_request(mem, tokens, chunk=2048, use_cache=use_cache, on_step=check)
        assert max(held) <= -(-w // ps) + 1, held
        mem.check_conservation()
        in_tree = int(mem.windows.present(mem.tree.tree_page_ids()).sum())
        if use_cache:   # first window, 7 checkpoints and the end: 9 windows of 32+1 pages
            assert in_tree <= 9 * (w // ps + 1) < len(tokens) // ps // 6
        else:
            assert in_tree == 0 and mem.windows.num_free == 400


def test_window_eviction_keeps_earlier_points_matchable():
    """sglang#35515: losing a branch's tail window loses that point only."""
    mem = make_memory(64, 30, window=4, page_size=2, checkpoint=8)
    donor = list(range(100, 132))                       # 32 tokens: checkpoints 8, 16, 24
    run_request(mem, donor)
    full_before = len(mem.tree.tree_page_ids())
    leaf = next(mem.tree.iter_evictable())
    mem.drop_windows(leaf.pages[-2:])                    # the end's window is gone
    assert len(mem.tree.tree_page_ids()) == full_before  # full-attention KV all kept
    lease = WindowedLease(mem)
    lease.acquire(donor + [1], max_tokens=32)
    assert lease.matched_tokens == 24 and lease.window_short == 8
    assert window_present(mem, lease)
    lease.release()
    mem.check_conservation()


def test_a_short_windowed_pool_drops_windows_before_full_pages():
    mem = make_memory(64, 12, window=4, page_size=2, checkpoint=8)
    run_request(mem, list(range(100, 124)))
    tree_pages = set(mem.tree.tree_page_ids().tolist())
    run_request(mem, list(range(50, 66)))                # needs more windows than are free
    assert mem.dropped_windows > 0
    assert tree_pages <= set(mem.tree.tree_page_ids().tolist())  # no full page evicted
    mem.check_conservation()


def test_a_second_request_refills_the_branch_window():
    mem = make_memory(128, 64, window=4, page_size=2, checkpoint=64)
    system = list(range(100, 124))                       # 24 tokens, no checkpoint inside
    run_request(mem, system + [1, 2, 3, 4])
    first = WindowedLease(mem)
    first.acquire(system + [5, 6], max_tokens=26)
    assert first.matched_tokens == 4                     # only the first window's points
    first.release()
    run_request(mem, system + [5, 6, 7, 8])               # computes and keeps 24's window
    again = WindowedLease(mem)
    again.acquire(system + [9, 9], max_tokens=26)
    assert again.matched_tokens == 24 and window_present(mem, again)
    again.release()
    mem.check_conservation()


def test_a_short_windowed_pool_keeps_the_windows_at_leaf_and_branch_ends():
    """Windows inside a path (a turn's old end) go before those at a leaf's end (the next
    turn) or a branch node's end (a shared system prompt), even when used more recently:
    plain LRU dropped the system prompt's window, so a conversation the tree lost matched
    0 tokens instead of the prompt (the thrash case of scripts/bench_hybrid.py)."""
    mem = make_memory(128, 40, window=4, page_size=2, checkpoint=64)
    system = list(range(100, 124))                    # 24 tokens: a branch point at 24
    a1, b1, a2 = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]
    for tokens in (system + a1, system + b1, system + b1, system + a1 + a2):
        run_request(mem, tokens)        # the 2nd B refills 24's window; A's turn 2 reads 30's
    (a1_node,) = [n for n in mem.tree.iter_nodes() if n.depth == 30 and n.children]
    old_end = a1_node.pages[-2:]                      # the window of A's turn-1 end, [26, 30)
    assert mem.windows.present(old_end).all()
    held = mem.alloc(mem.windows.num_free + 4)         # 4 tree windows must go
    assert mem.dropped_windows == 4
    assert not mem.windows.present(old_end).any()      # inside A's path now
    for tokens, hit in ((system + [99], 24), (system + b1 + [99], 30),
                        (system + a1 + a2 + [99], 36)):
        lease = WindowedLease(mem)
        lease.acquire(tokens, max_tokens=len(tokens) - 1)
        assert lease.matched_tokens == hit and window_present(mem, lease)
        lease.release()
    mem.free(held)
    mem.check_conservation()


class WindowTree(RuleBasedStateMachine):
    """Requests over a small alphabet (many shared prefixes and divergences inside pages),
    a tight windowed pool, window and full evictions."""

    def __init__(self):
        super().__init__()
        self.mem = make_memory(48, 14, window=4, page_size=2, checkpoint=8)

    @rule(head=st.lists(st.integers(0, 2), min_size=1, max_size=30),
          keep=st.booleans(), chunk=st.integers(1, 9))
    def request(self, head, keep, chunk):
        tokens = head + [7]
        lease = WindowedLease(self.mem)
        lease.acquire(tokens, max_tokens=len(tokens) - 1)
        assert window_present(self.mem, lease)
        assert lease.matched_tokens <= len(tokens) - 1
        lease.release()
        run_request(self.mem, tokens, chunk=chunk, keep=keep)

    @rule(n=st.integers(1, 10))
    def evict_full(self, n):
        self.mem.free(self.mem.tree.evict(n * self.mem.page_size))

    @rule()
    def drop_lru_windows(self):
        leaf = next(self.mem.tree.iter_evictable(), None)
        if leaf is not None:
            self.mem.drop_windows(leaf.pages)

    @invariant()
    def pools_conserved(self):
        self.mem.check_conservation()
        self.mem.tree.check_invariants()

    @invariant()
    def end_pages_are_the_last_windows_before_each_leaf_and_branch(self):
        """WindowedMemory._end_pages (the drop order's walk) against its definition, by
        whole paths: the last pages (a window's and one more) of the path to every leaf
        or branch node."""
        mem = self.mem
        per_window = -(-mem.rule.window // mem.page_size) + 1
        want = set()
        for node in mem.tree.iter_nodes():
            if len(node.children) != 1:
                path, up = [], node
                while up is not None and up.depth:
                    path[:0] = up.pages.tolist()
                    up = up.parent
                want.update(path[-per_window:])
        assert set(mem._end_pages().tolist()) == want


TestWindowTree = WindowTree.TestCase
TestWindowTree.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_windows_follow_a_node_to_lower_tier_ids_and_back():
    """WindowPages.take_over: a demoted node's windows live under its host/disk ids (the
    pool's map unchanged in size), come back with a load, and a released id frees its
    window; conservation counts the lower ids as owned."""
    from radixserve.cache.window_pages import WindowPages
    w = WindowPages(5, 8)                       # 5 windowed pages; pool ids 0..7
    w.attach(np.array([1, 2, 3]))
    w.take_over(np.array([1, 2]), np.array([1_000_000, 1_000_001]))     # demoted to disk
    assert len(w.of_page) == 8 and w.present(np.array([1, 2, 1_000_000, 1_000_001])).tolist() \
        == [False, False, True, True]
    w.check([np.array([3, 1_000_000, 1_000_001])])
    w.attach(np.array([5, 6]))                  # a load's fresh pages first get windows...
    w.take_over(np.array([1_000_000, 1_000_001]), np.array([5, 6]))     # ...then the node's
    assert w.present(np.array([5, 6, 1_000_000])).tolist() == [True, True, False]
    assert w.num_free == 2 and w.lower == {}
    w.take_over(np.array([5]), np.array([2_000]))
    assert w.detach(np.array([2_000, 6])) == 2 and w.num_free == 4
    w.check([np.array([3])])
    with pytest.raises(AssertionError, match="owned by nobody"):
        w.check([np.zeros(0, np.int64)])


class JournalPlaces:
    """A journaled disk tier's DiskPlaces (engine/disk_places.py), minus the journal: every
    page it is told of has its file, so a disk node that moves into the pool keeps its
    slots as kept copies (LowerTiers.release)."""

    def placed(self, node, slots):
        pass

    def missing(self, node):
        return False

    def touched(self, slots, last_access):
        pass

    def spare(self, kept, n):
        return list(kept)[:n]


def test_a_disk_path_recomputed_into_the_pool_lets_its_old_windows_go():
    """A path on a journaled disk tier that a request recomputes (matched, not loaded, as
    when its windows are missing or its read is slow) enters the pool on the request's
    pages; its disk slots stay as kept copies, but the windows that followed it to those
    slots must go, or they are held for a node nobody owns (CI, test_engine_hybrid_tiers:
    "owned by nobody")."""
    from radixserve.cache.tiers import DISK, LowerTiers

    from .test_tiers import run
    from .test_tiers_stateful import FakeDisk

    mem = make_memory(16, 16)
    store = FakeDisk()
    tiers = LowerTiers(mem.tree, 16, 0, 16, store, page_bytes=16)
    tiers.places = JournalPlaces()
    mem.follow(tiers)
    path = list(range(100, 116))                       # 8 pages of 2
    run_request(mem, path)
    mem.free(mem.tree.evict(16))                       # the whole path to disk
    run(tiers, store)
    assert mem.tree.match_prefix(path).lower_tokens(DISK) == 16
    assert mem.windows.lower                           # its windows followed it
    mem.check_conservation()
    run_request(mem, path)              # matched on disk, not loaded: recomputed, inserted
    assert mem.tree.match_prefix(path).matched_tokens == 16
    assert tiers.kept and not mem.windows.lower        # the slots kept, their windows gone
    mem.tree.check_invariants()
    mem.check_conservation()
