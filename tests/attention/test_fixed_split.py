"""Deterministic mode's attention: a query's output is bit-identical whatever it is computed
with (batch, prefill chunk, cached or not, page size, padding), and close to exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.attention.fixed_split import FixedSplitBackend, row_max, split_attention
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import SeqSpan, build_metadata
from tests.attention.attn_helpers import Scenario, dense_attention

HQ, HKV, D = 9, 3, 64


def make_seq(length: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(length, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))


def run_step(seqs, page_size: int, dtype: torch.dtype, seed: int = 0, split: int = 64,
             window: int | None = None):
    """seqs: (q, k, v, cached, new) per sequence (full-length tensors); prefills first.
    Returns each sequence's outputs for its new tokens (``window``: a sliding-window layer)."""
    rng = np.random.default_rng(seed)
    need = [-(-(c + n) // page_size) for _, _, _, c, n in seqs]
    pool = KVPool(1, sum(need) + 3, page_size, HKV, D, dtype, "cpu")
    perm = rng.permutation(pool.num_pages).astype(np.int32)
    spans, qs, ks, vs, off = [], [], [], [], 0
    for (q, k, v, cached, new), npages in zip(seqs, need):
        pages = perm[off:off + npages]
        off += npages
        for p in range(cached):
            s = int(pages[p // page_size]) * page_size + p % page_size
            pool.k_flat[0][s], pool.v_flat[0][s] = k[p], v[p]
        spans.append(SeqSpan(pages=pages, cached_len=cached, new_len=new))
        qs.append(q[cached:cached + new])
        ks.append(k[cached:cached + new])
        vs.append(v[cached:cached + new])
    backend = FixedSplitBackend(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, split=split,
                                layer_windows=None if window is None else [window])
    plan = backend.prepare(build_metadata(spans, page_size, "cpu"))
    out = backend.forward(plan, 0, torch.cat(qs), torch.cat(ks), torch.cat(vs), pool)
    return list(out.split([n for *_, n in seqs]))


@pytest.mark.parametrize("dtype,window", [
    (torch.bfloat16, None), (torch.float16, None), (torch.float32, None),
    (torch.bfloat16, 100)])      # window 100: chunks of 64 fall wholly outside it
def test_query_output_independent_of_how_it_is_computed(dtype, window):
    length = 300
    q, k, v = make_seq(length, 1, dtype)
    others = [make_seq(n, 10 + n, dtype) for n in (77, 150, 420)]

    def run_step(*args, **kw):
        return globals()["run_step"](*args, **kw, window=window)

    # (a) alone, whole prompt in one prefill, page size 1
    alone = run_step([(q, k, v, 0, length)], 1, dtype)[0]
    # (b) in chunks of 37 after a cached prefix, in a batch with other prefills and decodes,
    #     page size 16
    for cached in (0, 37, 128, 200, 299):
        new = length - cached
        batch = [(*others[0], 10, 67), (q, k, v, cached, new), (*others[1], 0, 150),
                 (*others[2], 419, 1), (*others[0], 76, 1)]
        batch = [s for s in batch if s[4] > 1] + [s for s in batch if s[4] == 1]
        if new == 1:
            batch = [s for s in batch if s[4] > 1] + [(q, k, v, cached, 1)] + \
                [s for s in batch if s[4] == 1]
            got = run_step(batch, 16, dtype, seed=cached)[2]
        else:
            got = run_step(batch, 16, dtype, seed=cached)[1]
        assert torch.equal(got, alone[cached:]), f"cached={cached}"
    # (c) each of the last 20 positions as a decode, alone and among longer decodes
    for pos in range(length - 20, length):
        single = run_step([(q, k, v, pos, 1)], 4, dtype)[0]
        among = run_step([(*others[2], 400, 1), (q, k, v, pos, 1), (*others[1], 149, 1)],
                         16, dtype, seed=pos)[1]
        assert torch.equal(single, alone[pos:pos + 1])
        assert torch.equal(among, alone[pos:pos + 1])


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float16, None),
                                          (torch.bfloat16, 100), (torch.float16, 70)])
def test_close_to_exact_attention(dtype, window):
    q, k, v = make_seq(260, 3, dtype)
    got = run_step([(q, k, v, 100, 160)], 16, dtype, window=window)[0]
    ref = dense_attention(Scenario([SeqSpan(np.arange(17, dtype=np.int32), 100, 160)],
                                   [k], [v], q[100:], k[100:], v[100:]), D ** -0.5,
                          window=window)
    err = (got.double() - ref).abs().max().item()
    assert err < (0.02 if dtype == torch.bfloat16 else 0.003), err


def test_split_attention_matmuls_are_row_and_batch_invariant():
    """The building block on raw tensors: one row's result whatever rows and batch join it."""
    g = torch.Generator().manual_seed(0)
    split, keys = 64, 256
    q = torch.randn(6, HKV, 40, D, generator=g).bfloat16()
    k = torch.randn(6, HKV, keys, D, generator=g).bfloat16()
    v = torch.randn(6, HKV, keys, D, generator=g).bfloat16()
    hidden = torch.zeros(1, 1, 1, 1, split, dtype=torch.bool)  # last chunk: none masked
    full = split_attention(q, k, v, hidden, keys // split - 1, split, 0.125)
    for b, r in ((1, 1), (2, 7), (6, 33)):
        part = split_attention(q[:b, :, :r], k[:b], v[:b], hidden, keys // split - 1, split,
                               0.125)
        assert torch.equal(part, full[:b, :, :r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_max_is_exactly_amax(dtype):
    """row_max reads the floats' bits as integers: check rows of every sign mix, zeros of
    both signs, the dtype's extremes and strided views against amax."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 40, 256, generator=g) * 30).to(dtype)
    x[0] = -x[0].abs()                          # all negative
    x[1] = x[1].abs()                           # all non-negative
    x[2, :, :128] = -0.0                        # -0.0 beside negatives
    x[2, :, 128:] = -x[2, :, 128:].abs()
    x[3, ::2] = 0.0                             # +0.0 as the max of some rows
    x[3, ::2, :5] = -0.0
    x[3, ::2, 5:] = -x[3, ::2, 5:].abs()
    x[4, :, 7] = torch.finfo(dtype).min         # masked-style extremes
    x[4, 3] = torch.finfo(dtype).min
    x[5, :, 9] = torch.finfo(dtype).max
    for view in (x, x[:, ::3], x.transpose(0, 1)):
        got, want = row_max(view), view.amax(-1)
        assert got.dtype == want.dtype and torch.equal(got, want)
    # -0.0 == +0.0 for torch.equal: rows of -0.0 and negatives, bit for bit (-0.0)
    assert torch.equal(row_max(x[2]).view(torch.uint8), x[2].amax(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_with_preceding_chunks_equals_merge_of_concatenation(dtype):
    """merge_chunks(o, lse, before=(o0, lse0)) gives the bits of merging cat([o0, o]) and
    cat([lse0, lse]), including chunks weighted 0 (lse -inf) on either side."""
    from radixserve.attention.fixed_split import merge_chunks
    gen = torch.Generator().manual_seed(3)
    o0, o1 = (torch.randn(6, 3, c, 3, 64, generator=gen).to(dtype) for c in (4, 2))
    l0, l1 = (torch.randn(6, 3, c, 3, generator=gen) * 4 for c in (4, 2))
    l0[1] = float("-inf")                 # a decode in no group: its shared chunks weigh 0
    l1[2, :, 1] = float("-inf")
    want = merge_chunks(torch.cat([o0, o1], 2), torch.cat([l0, l1], 2))
    assert torch.equal(merge_chunks(o1, l1, (o0, l0)), want)
    assert torch.isfinite(want.float()).all()


def test_fp16_decode_batched_with_a_longer_one_stays_finite():
    """A short decode batched with a longer one reads chunks past its end (its padding,
    re-reading its last key), wholly masked. In fp16, masking by adding the lowest value
    (-65504) turned every such score <= -16 into -inf, the chunk's softmax into NaN, and the
    decode's output into NaN (greedy token 0). Here its last key scores -32 for every head:
    the batched output must equal the decode alone and stay close to float32's."""
    def seqs(dtype):
        short, long_ = make_seq(10, 1, dtype), make_seq(100, 2, dtype)
        q, k, v = (t.clone() for t in short)
        q[-1], k[-1] = 2.0, -2.0           # q.k * D**-0.5 = -4 * 64 / 8 = -32
        return (q, k, v, 9, 1), (*long_, 99, 1)
    batched = run_step(list(seqs(torch.float16)), page_size=16, dtype=torch.float16)[0]
    alone = run_step([seqs(torch.float16)[0]], page_size=16, dtype=torch.float16)[0]
    exact = run_step(list(seqs(torch.float32)), page_size=16, dtype=torch.float32)[0]
    assert torch.isfinite(batched).all()
    assert torch.equal(batched, alone)
    torch.testing.assert_close(batched.float(), exact, atol=2e-3, rtol=2e-3)
