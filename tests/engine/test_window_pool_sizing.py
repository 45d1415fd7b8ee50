"""kv_sizing.group_pool_pages with a byte budget: the windowed pool's floor (one request of
the full context) never pushes both pools past the budget; when it cannot fit beside one
full page the start is refused with the flags named."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from radixserve.kv_sizing import KVFormat, group_pool_pages, layer_groups

PAGE = 16
# Gemma-3-1B-shaped: 26 layers, 1 KV head of 256, 5 windowed to each global (fp32 bytes).
GROUPS = layer_groups(KVFormat("float32", "float32"), [512] * 22 + [None] * 4, 1, 256)


def test_a_floor_larger_than_the_fraction_takes_its_bytes_from_the_full_pages():
    budget = 64 << 20
    plain = group_pool_pages(GROUPS, page_size=PAGE, kv_cache_tokens=None, budget=budget,
                             fraction=0.09)
    floored = group_pool_pages(GROUPS, page_size=PAGE, kv_cache_tokens=None, budget=budget,
                               fraction=0.09, floor=plain.window_pages + 10)
    assert floored.window_pages == plain.window_pages + 10
    assert floored.full_pages < plain.full_pages
    assert floored.pool_bytes(GROUPS, PAGE) <= budget


def test_a_floor_that_leaves_no_full_page_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match="--max-model-len.*--kv-cache-tokens"):
        group_pool_pages(GROUPS, page_size=PAGE, kv_cache_tokens=None, budget=8 << 20,
                         fraction=0.09, floor=10_000)


@settings(max_examples=100, deadline=None)
@given(windows=st.lists(st.sampled_from([None, 64]), min_size=1, max_size=8),
       budget=st.integers(1 << 10, 1 << 26), fraction=st.floats(0.01, 1.0),
       floor=st.integers(1, 4000))
def test_both_pools_stay_within_the_budget(windows, budget, fraction, floor):
    groups = layer_groups(KVFormat("bfloat16", "bfloat16"), [*windows, 64], 2, 32)
    try:
        pools = group_pool_pages(groups, page_size=PAGE, kv_cache_tokens=None,
                                 budget=budget, fraction=fraction, floor=floor)
    except ValueError as e:
        assert "--max-model-len" in str(e)
        return
    assert pools.pool_bytes(groups, PAGE) <= budget
    assert 1 <= pools.window_pages <= pools.full_pages
    assert pools.window_pages >= min(floor, pools.full_pages)
