"""Coalesced trims (TreeFacts): the trims a step makes reach the publisher as one fact, each
leaf at its final length. The stream must be the one the tree's own calls make: the same
events in the same places, a BlockRemoved's hashes in another order at most, and an index
built from it equal to the tree's whole blocks. Pool-only trees, the only ones that trim
(tiered eviction splits and demotes instead); page size 1 trims the LRU leaf once per
page allocated, the case coalescing is for."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import OutOfPages, PagedMemory, RadixCache
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.events.block_events import BlockEvents, media_for
from radixserve.events.schema import ENCODINGS
from radixserve.events.tree_facts import REMOVED, TRIMMED, FactReplay, TreeFacts
from tests.events.consumers import DynamoIndex

BLOCK = 4
CLASSES = ENCODINGS["array"]


class Both:
    """The tree's observer: the facts (replayed later, as the engine does) and, directly,
    BlockEvents on the tree itself (the reference); counts the tree's trim calls."""

    def __init__(self, facts: TreeFacts, direct: BlockEvents):
        self.facts, self.direct = facts, direct
        self.trim_calls = 0

    def stored(self, node):
        self.facts.stored(node)
        self.direct.stored(node)

    def split(self, upper, lower):
        self.facts.split(upper, lower)
        self.direct.split(upper, lower)

    def removed(self, node):
        self.facts.removed(node)
        self.direct.removed(node)

    def trimmed(self, node, keep_tokens):
        self.trim_calls += 1
        self.facts.trimmed(node, keep_tokens)
        self.direct.trimmed(node, keep_tokens)

    def moved(self, node, src):
        self.facts.moved(node, src)
        self.direct.moved(node, src)

    def cleared(self):
        self.facts.cleared()
        self.direct.cleared()


def same_events(got, want) -> None:
    """Event for event equal; a BlockRemoved's hashes as a multiset."""
    assert (got is None) == (want is None)
    if got is None:
        return
    assert len(got.events) == len(want.events)
    for a, b in zip(got.events, want.events):
        assert type(a) is type(b)
        if type(a) is CLASSES.BlockRemoved:
            assert a.medium == b.medium
            assert sorted(a.block_hashes) == sorted(b.block_hashes)
        else:
            assert a == b


# An op: ("req", head index, tail tokens, keep the lease) | ("evict", tokens) | ("step",)
#        | ("flush",)
OPS = st.lists(st.one_of(
    st.tuples(st.just("req"), st.integers(0, 2), st.lists(st.integers(0, 3), max_size=9),
              st.booleans()),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("step")),
    st.tuples(st.just("flush"))), max_size=60)


def play(ops: list, page_size: int) -> int:
    """Run `ops` on a small pool-only tree, checking the stream at each step; returns how
    many trim calls were coalesced away."""
    heads = [[9, 8, 7, 6, 5, 4], [9, 8, 7, 1], [2] * 7]
    tree = RadixCache(page_size)
    mem = PagedMemory(24, tree)
    facts = TreeFacts()
    replay = FactReplay(BlockEvents(CLASSES, BLOCK, page_size, media_for("cpu")))
    both = Both(facts, BlockEvents(CLASSES, BLOCK, page_size, media_for("cpu")))
    tree.attach_observer(both)
    index = DynamoIndex(BLOCK)
    leases: list[PrefixLease] = []
    prompts: set[tuple] = set()
    marks: list[tuple[int, int]] = []   # (fact mark, the reference's event index)
    trims_sent = 0

    def step() -> None:
        nonlocal trims_sent
        taken = facts.take()
        trims_sent += sum(len(f[1]) for f in taken if f[0] == TRIMMED)
        got, want = replay.batch(taken), both.direct.take_batch()
        same_events(got, want)
        for mark, pos in marks:
            assert replay.positions[mark] == pos
        marks.clear()
        if got is not None:
            index.apply(got)
        for p in prompts:
            assert index.matched_blocks(list(p), None) == tree.peek_prefix(list(p)) // BLOCK

    for op in ops + [("step",)]:
        if op[0] == "req":
            tokens = heads[op[1]] + op[2]
            marks.append((facts.mark(), both.direct.mark()))
            lease = PrefixLease(mem, None)
            lease.acquire(tokens)
            try:
                lease.grow(-(-len(tokens) // page_size) - len(lease.pages))
            except OutOfPages:
                lease.release()
                continue
            lease.extend(tokens, len(tokens))
            prompts.add(tuple(tokens))
            if op[3] and len(leases) < 2:
                leases.append(lease)
            else:
                lease.release()
        elif op[0] == "evict":
            if leases and op[1] % 2:
                leases.pop(0).release()
            mem.free(tree.evict(op[1]))
        elif op[0] == "flush" and not leases:
            mem.flush_cache()
        else:
            step()
        tree.check_invariants()
        mem.check_conservation([lease.private_pages for lease in leases])
    return both.trim_calls - trims_sent


@settings(max_examples=60, deadline=None)
@given(ops=OPS, page_size=st.sampled_from([1, 2]))
def test_coalesced_trims_make_the_trees_own_stream(ops, page_size):
    play(ops, page_size)


def test_runs_of_evictions_are_coalesced():
    """A fixed run that trims one leaf page by page: fewer trims reach the publisher than
    the tree made, and the stream is still the reference's."""
    ops = [("req", 0, [1, 2, 3, 1, 2, 3, 1, 2, 3], False), ("req", 2, [3] * 9, False)]
    ops += [("evict", 1)] * 8 + [("step",)] + [("req", 1, [0] * 9, False), ("evict", 2)] * 3
    assert play(ops, page_size=1) > 0


def test_a_child_under_a_split_then_trimmed_node_chains_from_its_cut():
    """Found by the property test (BlockEvents, coalescing or not): a node made by a split
    has no chain state; trimming it computed one at its old end and kept it, so a child
    stored under it later hashed from the tokens the trim cut off."""
    play([("req", 0, [0], False), ("req", 0, [], False), ("evict", 4), ("req", 0, [], False)],
         page_size=1)


def test_a_leaf_trimmed_then_removed_in_one_run_is_only_removed():
    """Two eviction calls with nothing between: the first trims a leaf, the second takes
    the rest of it. The run's facts name the leaf in both REMOVED and TRIMMED (removals
    are applied first), the replay skips the trim, and the events are the tree's own."""
    tree = RadixCache(1)
    mem = PagedMemory(24, tree)
    facts = TreeFacts()
    replay = FactReplay(BlockEvents(CLASSES, BLOCK, 1, media_for("cpu")))
    both = Both(facts, BlockEvents(CLASSES, BLOCK, 1, media_for("cpu")))
    tree.attach_observer(both)
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12, 13, 14, 15]):
        lease = PrefixLease(mem, None)
        lease.acquire(tokens)
        lease.grow(len(tokens) - len(lease.pages))
        lease.extend(tokens, len(tokens))
        lease.release()
    index = DynamoIndex(BLOCK)
    first = replay.batch(facts.take())
    same_events(first, both.direct.take_batch())
    index.apply(first)
    mem.free(tree.evict(3))         # the LRU leaf (the first prompt's tail) loses 3
    mem.free(tree.evict(4))         # and then the rest of it
    taken = facts.take()
    kinds = [f[0] for f in taken]
    assert kinds == [REMOVED, TRIMMED]
    assert set(taken[0][1]) & set(taken[1][1])      # one leaf in both
    got, want = replay.batch(taken), both.direct.take_batch()
    same_events(got, want)
    index.apply(got)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12, 13, 14, 15]):
        assert index.matched_blocks(prompt, None) == tree.peek_prefix(prompt) // BLOCK
    tree.check_invariants()
    mem.check_conservation([])
