"""EvictionQueue against a brute-force model: a dict of node -> key, smallest (key, id) first."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.eviction_queue import EvictionQueue
from radixserve.cache.radix_cache import EMPTY_PAGES
from radixserve.cache.tree_node import TreeNode


def _nodes(n: int) -> list[TreeNode]:
    return [TreeNode(i + 1, b"", EMPTY_PAGES, None, 1, None) for i in range(n)]


def _expected(model: dict) -> list[TreeNode]:
    return sorted(model, key=lambda node: (model[node], node.id))


ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "rekey", "pop"]),
                         st.integers(0, 11), st.integers(0, 5)), max_size=300)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_matches_a_sorted_model_through_lazy_removals_and_compactions(steps):
    nodes = _nodes(12)
    queue, model = EvictionQueue(), {}
    for op, i, key in steps:
        node = nodes[i]
        if op == "add" and node not in model:
            queue.add(node, key)
            model[node] = key
        elif op == "discard" and node in model:
            queue.discard(node)
            del model[node]
        elif op == "rekey" and node in model:
            queue.rekey(node, key)
            model[node] = key
        elif op == "pop":
            want = _expected(model)
            got = queue.pop()
            assert got is (want[0] if want else None)
            if got is not None:
                del model[got]
                assert got.evict_key is None
        assert len(queue) == len(model)
        assert queue.first() is (_expected(model)[0] if model else None)
    assert list(queue) == _expected(model)
    assert all(node.evict_key is not None and node.evict_key[:2] == (k, node.id)
               for node, k in model.items())


def test_stale_entries_are_compacted_away():
    """Removing and re-adding one node many times must not grow the heap without bound."""
    nodes = _nodes(4)
    queue = EvictionQueue()
    for node in nodes:
        queue.add(node, 0)
    rng = random.Random(0)
    for step in range(10_000):
        node = rng.choice(nodes)
        queue.discard(node)
        queue.add(node, step)
    assert len(queue) == 4
    assert len(queue._heap) < 600          # live 4 + at most ~512 stale (see _COMPACT_FLOOR)
    assert list(queue) == sorted(nodes, key=lambda n: (n.evict_key[0], n.id))


def test_equal_keys_of_one_node_never_compare_the_nodes():
    """Discarding and re-adding a node with an unchanged key leaves two entries equal in
    (key, id); the sequence number must order them (TreeNode defines no ordering)."""
    (node,) = _nodes(1)
    queue = EvictionQueue()
    queue.add(node, 7)
    queue.discard(node)
    queue.add(node, 7)
    assert queue.pop() is node
    assert queue.pop() is None and len(queue) == 0
