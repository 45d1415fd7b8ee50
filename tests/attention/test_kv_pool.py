"""KVPool: layout, writes by slot, copy-on-write of a page prefix, sizing."""

import numpy as np
import pytest
import torch

from radixserve.attention.kv_pool import KVPool


def test_layout_is_nhd_and_zeroed():
    pool = KVPool(3, 10, 4, 2, 8, torch.bfloat16, "cpu")
    assert len(pool.k) == len(pool.v) == 3
    for t in pool.k + pool.v:
        assert t.shape == (10, 4, 2, 8) and t.dtype == torch.bfloat16
        assert not t.any()
    assert pool.num_slots == 40


def test_write_lands_at_page_offset():
    pool = KVPool(2, 6, 4, 2, 3, torch.float32, "cpu")
    slots = torch.tensor([0, 5, 23, 9])
    k = torch.randn(4, 2, 3)
    v = torch.randn(4, 2, 3)
    pool.write(1, slots, k, v)
    for i, s in enumerate(slots.tolist()):
        page, off = divmod(s, 4)
        assert torch.equal(pool.k[1][page, off], k[i])
        assert torch.equal(pool.v[1][page, off], v[i])
    assert not pool.k[0].any() and not pool.v[0].any()       # other layer untouched
    written = torch.zeros(24, dtype=torch.bool)
    written[slots] = True
    assert not pool.k_flat[1][~written].any()                 # nothing else written


def test_write_casts_to_pool_dtype_and_rejects_bad_shapes():
    pool = KVPool(1, 4, 1, 2, 4, torch.bfloat16, "cpu")
    k = torch.randn(2, 2, 4)
    pool.write(0, torch.tensor([1, 3]), k, k)
    assert torch.equal(pool.k_flat[0][1], k[0].bfloat16())
    with pytest.raises(ValueError, match="do not match"):
        pool.write(0, torch.tensor([1, 3]), torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="do not match"):
        pool.write(0, torch.tensor([1]), k, k)


def test_copy_prefix_all_layers_only_prefix():
    pool = KVPool(3, 5, 8, 2, 4, torch.float32, "cpu")
    for layer in range(3):
        pool.k[layer].normal_()
        pool.v[layer].normal_()
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v)]
    pool.copy_prefix(src_page=1, dst_page=3, num_tokens=5)
    for layer, (k0, v0) in enumerate(before):
        assert torch.equal(pool.k[layer][3, :5], k0[1, :5])
        assert torch.equal(pool.v[layer][3, :5], v0[1, :5])
        assert torch.equal(pool.k[layer][3, 5:], k0[3, 5:])   # the rest of dst unchanged
        mask = torch.ones(5, dtype=torch.bool)
        mask[3] = False
        assert torch.equal(pool.k[layer][mask], k0[mask])     # other pages unchanged
        assert torch.equal(pool.v[layer][mask], v0[mask])


@pytest.mark.parametrize("args, match", [
    ((0, 9, 1), "dst_page"), ((-1, 2, 1), "src_page"), ((1, 2, 9), "num_tokens"),
    ((2, 2, 1), "both 2"),
])
def test_copy_prefix_rejects_bad_arguments(args, match):
    pool = KVPool(1, 5, 8, 1, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        pool.copy_prefix(*args)


def test_sizes_and_budget():
    pool = KVPool(4, 10, 16, 3, 64, torch.bfloat16, "cpu")
    assert pool.bytes_per_token == 2 * 4 * 3 * 64 * 2
    assert pool.total_bytes == pool.bytes_per_token * 160
    assert pool.total_bytes == sum(t.numel() * t.element_size() for t in pool.k + pool.v)
    page = pool.bytes_per_token * 16
    n = KVPool.pages_for_budget(10 * page + page - 1, 4, 16, 3, 64, torch.bfloat16)
    assert n == 10
    assert KVPool.pages_for_budget(page, 4, 16, 3, 64, "bfloat16") == 1
    with pytest.raises(ValueError, match="less than one page"):
        KVPool.pages_for_budget(page, 4, 16, 3, 64, torch.float32)   # fp32 page is 2x


@pytest.mark.parametrize("kwargs", [dict(num_pages=0), dict(page_size=-1),
                                    dict(head_dim=2.5), dict(dtype="int8")])
def test_constructor_validates(kwargs):
    base = dict(num_layers=1, num_pages=4, page_size=1, num_kv_heads=1, head_dim=4,
                dtype=torch.float32, device="cpu")
    base.update(kwargs)
    with pytest.raises(ValueError):
        KVPool(**base)


def test_pool_accepts_numpy_int32_page_ids_via_slots():
    # Page ids are int32 numpy arrays in cache/ and engine/; slots are built from them.
    pool = KVPool(1, 8, 2, 1, 2, torch.float32, "cpu")
    pages = np.array([5, 2], dtype=np.int32)
    slots = torch.from_numpy(pages.astype(np.int64) * 2 + 1)
    pool.write(0, slots, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert pool.k[0][5, 1].eq(1).all() and pool.k[0][2, 1].eq(1).all()
    assert pool.k[0].sum() == 4
