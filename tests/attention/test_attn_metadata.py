"""build_metadata against a brute-force construction of the CSR page table."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_helpers import slot_of
from radixserve.attention.metadata import SeqSpan, build_metadata


def brute_force(spans, page_size):
    """The page table written out the slow, obvious way."""
    qo, kv, idx, last, slots = [0], [0], [], [], []
    for s in spans:
        kv_len = s.cached_len + s.new_len
        n_pages = (kv_len + page_size - 1) // page_size
        qo.append(qo[-1] + s.new_len)
        kv.append(kv[-1] + n_pages)
        idx.extend(int(p) for p in s.pages[:n_pages])
        last.append(kv_len - (n_pages - 1) * page_size)
        slots.extend(slot_of(s.pages, p, page_size) for p in range(s.cached_len, kv_len))
    return qo, kv, idx, last, slots


def check(spans, page_size):
    meta = build_metadata(spans, page_size, "cpu")
    qo, kv, idx, last, slots = brute_force(spans, page_size)
    for name, t, dtype in [("qo_indptr", meta.qo_indptr, torch.int32),
                           ("kv_indptr", meta.kv_indptr, torch.int32),
                           ("kv_indices", meta.kv_indices, torch.int32),
                           ("kv_last_page_len", meta.kv_last_page_len, torch.int32),
                           ("write_slots", meta.write_slots, torch.int64)]:
        assert t.dtype == dtype, name
    assert meta.qo_indptr.tolist() == qo
    assert meta.kv_indptr.tolist() == kv
    assert meta.kv_indices.tolist() == idx
    assert meta.kv_last_page_len.tolist() == last
    assert meta.write_slots.tolist() == slots
    assert meta.qo_lens == [s.new_len for s in spans]
    assert meta.kv_lens == [s.cached_len + s.new_len for s in spans]
    assert all(type(x) is int for x in meta.qo_lens + meta.kv_lens)
    assert all(1 <= x <= page_size for x in last)
    assert meta.num_prefills == sum(s.new_len > 1 for s in spans)
    assert meta.page_size == page_size
    return meta


def span(pages, cached, new):
    return SeqSpan(pages=np.asarray(pages, dtype=np.int32), cached_len=cached, new_len=new)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch(page_size):
    rng = np.random.default_rng(page_size)
    lens = [(0, 7), (13, 20), (33, 2), (5, 1), (0, 1), (47, 1), (16, 1)]
    perm = rng.permutation(200).astype(np.int32)
    spans, off = [], 0
    for cached, new in lens:
        n = (cached + new + page_size - 1) // page_size
        spans.append(span(perm[off:off + n + 2], cached, new))   # extra ids are ignored
        off += n + 2
    meta = check(spans, page_size)
    assert meta.num_prefills == 3 and meta.num_decodes == 4
    assert meta.num_tokens == 7 + 20 + 2 + 4


def test_page_size_four_by_hand():
    # 6 cached + 3 new = 9 tokens -> pages [7, 2, 9], last page holds 1 token.
    meta = check([span([7, 2, 9, 4], 6, 3), span([5, 1], 4, 1)], 4)
    assert meta.kv_indptr.tolist() == [0, 3, 5]
    assert meta.kv_indices.tolist() == [7, 2, 9, 5, 1]
    assert meta.kv_last_page_len.tolist() == [1, 1]
    assert meta.write_slots.tolist() == [2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 1 * 4 + 0]


def test_empty_batch():
    meta = check([], 4)
    assert meta.qo_indptr.tolist() == [0] and meta.kv_indptr.tolist() == [0]
    assert meta.kv_indices.numel() == 0 and meta.write_slots.numel() == 0
    assert meta.num_prefills == 0 and meta.batch_size == 0 and meta.num_tokens == 0


def test_single_token_cases():
    meta = check([span([3], 0, 1)], 1)                 # first token of a sequence
    assert meta.num_prefills == 0 and meta.write_slots.tolist() == [3]
    meta = check([span([3, 8], 15, 1)], 16)            # decode filling a page exactly
    assert meta.kv_last_page_len.tolist() == [16] and meta.kv_indices.tolist() == [3]
    meta = check([span([3, 8], 16, 1)], 16)            # decode opening a new page
    assert meta.kv_last_page_len.tolist() == [1] and meta.write_slots.tolist() == [8 * 16]


def test_prefill_after_decode_is_rejected():
    with pytest.raises(ValueError, match="prefill-first"):
        build_metadata([span([1], 0, 1), span([2, 3], 0, 2)], 1, "cpu")


@pytest.mark.parametrize("bad, match", [
    (span([1, 2], 0, 3), "need 3 pages"),
    (span([1, 2], 1, 0), "new_len"),
    (span([1, 2], -1, 1), "cached_len"),
])
def test_invalid_spans(bad, match):
    with pytest.raises(ValueError, match=match):
        build_metadata([bad], 1, "cpu")


def test_invalid_page_size():
    with pytest.raises(ValueError, match="page_size"):
        build_metadata([span([1], 0, 1)], 0, "cpu")


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 16]),
       prefills=st.lists(st.tuples(st.integers(0, 40), st.integers(2, 30)), max_size=4),
       decodes=st.lists(st.integers(0, 60), max_size=6), seed=st.integers(0, 2**16))
def test_random_batches_match_brute_force(page_size, prefills, decodes, seed):
    rng = np.random.default_rng(seed)
    lens = prefills + [(c, 1) for c in decodes]
    need = [(c + n + page_size - 1) // page_size for c, n in lens]
    perm = rng.permutation(max(sum(need), 1)).astype(np.int32)
    spans, off = [], 0
    for (cached, new), n in zip(lens, need):
        spans.append(span(perm[off:off + n], cached, new))
        off += n
    check(spans, page_size)
