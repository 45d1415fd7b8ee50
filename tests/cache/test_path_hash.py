"""One path hash and one tree walk, for the disk store's saves and the cluster's digests:
against a brute force that hashes every node's whole root path as a prompt."""

import random

import numpy as np
import pytest

from radixserve.cache.path_hash import prompt_path_hashes, walk_path_hashes
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.token_keys import unpack
from radixserve.cluster.cache_digest import walk_hashes
from radixserve.cluster.prefix_hashes import prompt_hashes


def random_tree(page_size: int, seed: int) -> RadixCache:
    """Prompts sharing prefixes of random lengths (so edges split mid-block), 2 namespaces."""
    rng = random.Random(seed)
    tree = RadixCache(page_size=page_size)
    prompts: list[list[int]] = []
    next_page = 0
    for _ in range(12):
        base = rng.choice(prompts) if prompts and rng.random() < 0.8 else []
        keep = rng.randrange(len(base) + 1)
        tokens = base[:keep] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        tokens = tokens[:len(tokens) - len(tokens) % page_size]
        if not tokens:
            continue
        prompts.append(tokens)
        n = len(tokens) // page_size
        result = tree.insert(tokens, np.arange(next_page, next_page + n, dtype=np.int32),
                             rng.choice([None, "tenant"]))
        next_page += n
        assert result is not None
    return tree


def root_path(node) -> list[int]:
    parts = []
    while node is not None and node.depth:
        parts.append(unpack(node.key))
        node = node.parent
    return [t for part in reversed(parts) for t in part]


@pytest.mark.parametrize("page_size, block", [(1, 1), (1, 16), (4, 4), (4, 16), (2, 6)])
@pytest.mark.parametrize("seed", range(3))
def test_walk_names_each_block_as_its_prompt_would(page_size, block, seed):
    tree = random_tree(page_size, seed)
    seen = 0
    for node, hashes in walk_path_hashes(tree, block):
        path = root_path(node)
        start = node.depth - len(unpack(node.key))        # tokens above this edge
        expected = prompt_path_hashes(path, block, node.namespace)[start // block:]
        assert hashes == expected
        seen += len(hashes)
    assert seen > 0
    if block == page_size:                 # the disk store's use: one hash per page
        assert all(len(h) == len(n.pages) for n, h in walk_path_hashes(tree, block))


def test_routing_hashes_are_the_path_hashes_first_8_bytes():
    tokens = list(range(100, 164))
    path = prompt_path_hashes(tokens, 16, "a")
    assert len(path) == 4 and all(len(h) == 16 for h in path)
    assert prompt_hashes(tokens, 16, "a") == [int.from_bytes(h[:8], "little") for h in path]
    assert not set(path) & set(prompt_path_hashes(tokens, 16, "b"))
    assert not set(path) & set(prompt_path_hashes(tokens, 16, None))


def test_digest_is_the_walk_and_stops_at_max_blocks():
    tree = random_tree(1, 7)
    every = {int.from_bytes(h[:8], "little") for _, hs in walk_path_hashes(tree, 16) for h in hs}
    assert walk_hashes(tree, 16) == (frozenset(every), False)
    some, truncated = walk_hashes(tree, 16, max_blocks=2)
    assert truncated and 2 <= len(some) < len(every) and some <= every
