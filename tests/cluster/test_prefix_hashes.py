"""Block hashes: a replica's tree walk names exactly the blocks `prompt_hashes` names."""

import numpy as np
import pytest

from radixserve.cache.radix_cache import RadixCache
from radixserve.cluster.cache_digest import DigestMaker, walk_hashes
from radixserve.cluster.prefix_hashes import matched_blocks, prompt_hashes, routing_block_tokens


def insert(cache: RadixCache, tokens, namespace=None, first_page=[0]):
    n = len(tokens) // cache.page_size
    pages = np.arange(first_page[0], first_page[0] + n, dtype=np.int32)
    first_page[0] += n
    cache.insert(tokens, pages, namespace)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_walk_matches_prompt_hashes_across_split_edges(page_size):
    block = routing_block_tokens(page_size)
    cache = RadixCache(page_size=page_size)
    system = list(range(1000, 1040))                   # 40 tokens: blocks span edges
    a = system + list(range(1, 25))
    b = system + list(range(50, 74))
    insert(cache, a)
    insert(cache, b)                                    # splits a's edge mid-block
    held, truncated = walk_hashes(cache, block)
    assert not truncated
    expected = set(prompt_hashes(a, block, None)) | set(prompt_hashes(b, block, None))
    assert held == expected
    # a prompt sharing only the system prompt matches its whole blocks, not more
    c = system + [7] * 30
    assert matched_blocks(prompt_hashes(c, block, None), held) == len(system) // block


def test_namespaces_never_share_a_hash():
    cache = RadixCache(page_size=1)
    tokens = list(range(64))
    insert(cache, tokens, namespace="tenant-a")
    held, _ = walk_hashes(cache, 16)
    assert matched_blocks(prompt_hashes(tokens, 16, "tenant-a"), held) == 4
    assert matched_blocks(prompt_hashes(tokens, 16, "tenant-b"), held) == 0
    assert matched_blocks(prompt_hashes(tokens, 16, None), held) == 0


def test_digest_rewalks_only_after_a_change_and_sees_eviction_and_flush():
    cache = RadixCache(page_size=1)
    maker = DigestMaker(cache, 16)
    assert maker.digest().hashes == frozenset()
    insert(cache, list(range(32)))
    first = maker.digest()
    assert len(first.hashes) == 2 and maker.digest().version == first.version
    cache.evict(32)
    assert maker.digest().hashes == frozenset()
    insert(cache, list(range(48)))
    assert len(maker.digest().hashes) == 3
    cache.flush()
    assert maker.digest().hashes == frozenset()


def test_max_blocks_bounds_the_walk():
    cache = RadixCache(page_size=1)
    insert(cache, list(range(16 * 10)))
    held, truncated = walk_hashes(cache, 16, max_blocks=3)
    assert truncated and len(held) >= 3
