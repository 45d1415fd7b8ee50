"""What the flashinfer backend hands to plan(), checked without CUDA or flashinfer.

Fake wrappers record plan() arguments; an emulating fake also implements run() from those
CSR arguments alone (the semantics flashinfer documents), so the backend's token split and
CSR slicing are checked end to end against dense attention.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attn_helpers import dense_attention, make_scenario
from radixserve.attention.flashinfer_backend import (FlashInferBackend, decode_plan_call,
                                                     prefill_plan_call)
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.attention.kv_pool import KVPool


class RecordingWrapper:
    def __init__(self):
        self.plans = []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


class EmulatingWrapper(RecordingWrapper):
    """run() computes paged attention from the planned CSR only (bottom-right causal)."""

    def __init__(self, causal_expected):
        super().__init__()
        self.causal_expected = causal_expected

    def csr(self):
        args, kw = self.plans[-1]
        if len(args) == 7:     # decode plan: one query per sequence, no qo_indptr
            args = (torch.arange(len(args[0]), dtype=torch.int32), *args)
        return args, kw

    def run(self, q, cache):
        (qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, ps), kw = self.csr()
        assert kw.get("causal", False) is self.causal_expected
        k_cache, v_cache = cache
        out = torch.empty_like(q)
        for b in range(len(kv_indptr) - 1):
            pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
            kv_len = (len(pages) - 1) * ps + int(last[b])
            k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].transpose(0, 1)
            v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].transpose(0, 1)
            lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
            n = hi - lo
            q_pos = kv_len - n + torch.arange(n)[:, None]
            mask = torch.arange(kv_len)[None, :] <= q_pos
            if kw.get("window_left", -1) >= 0:      # keys within window_left of the query
                mask &= torch.arange(kv_len)[None, :] >= q_pos - kw["window_left"]
            o = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1).float(), k.float().repeat_interleave(hq // hkv, 0),
                v.float().repeat_interleave(hq // hkv, 0), attn_mask=mask, scale=kw["sm_scale"])
            out[lo:hi] = o.transpose(0, 1).to(q.dtype)
        return out


def spans_for(lens, page_size, seed=0):
    rng = np.random.default_rng(seed)
    need = [(c + n + page_size - 1) // page_size for c, n in lens]
    perm = rng.permutation(sum(need) + 5).astype(np.int32)
    out, off = [], 0
    for (c, n), k in zip(lens, need):
        out.append(SeqSpan(perm[off:off + k], c, n))
        off += k
    return out


KW = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, sm_scale=0.125)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_plan_arguments(page_size):
    lens = [(0, 9), (21, 6), (5, 1), (64, 1), (0, 1), (33, 1)]
    spans = spans_for(lens, page_size)
    meta = build_metadata(spans, page_size, "cpu")
    pre, dec = prefill_plan_call(meta, **KW), decode_plan_call(meta, **KW)

    n_pages = [(c + n + page_size - 1) // page_size for c, n in lens]
    last = [c + n - (k - 1) * page_size for (c, n), k in zip(lens, n_pages)]
    pages = [s.pages[:k].tolist() for s, k in zip(spans, n_pages)]

    qo, kvp, idx, lpl, hq, hkv, d, ps = pre.args
    assert qo.tolist() == [0, 9, 15]
    assert kvp.tolist() == [0, n_pages[0], n_pages[0] + n_pages[1]]
    assert idx.tolist() == pages[0] + pages[1]
    assert lpl.tolist() == last[:2]
    assert (hq, hkv, d, ps) == (8, 2, 64, page_size)
    assert pre.kwargs == dict(causal=True, sm_scale=0.125, q_data_type=torch.bfloat16,
                              kv_data_type=torch.bfloat16)
    for t in (qo, kvp, lpl, idx):
        assert t.dtype == torch.int32

    indptr, idx, lpl, hq, hkv, d, ps = dec.args
    assert indptr.tolist() == [0, *np.cumsum(n_pages[2:]).tolist()]     # rebased to 0
    assert idx.tolist() == sum(pages[2:], [])
    assert lpl.tolist() == last[2:]
    assert (hq, hkv, d, ps) == (8, 2, 64, page_size)
    assert "causal" not in dec.kwargs and dec.kwargs["q_data_type"] == torch.bfloat16
    assert indptr.dtype == torch.int32


def test_prefill_only_decode_only_and_empty():
    meta = build_metadata(spans_for([(0, 5), (3, 4)], 1), 1, "cpu")
    assert prefill_plan_call(meta, **KW) is not None and decode_plan_call(meta, **KW) is None
    meta = build_metadata(spans_for([(0, 1), (7, 1)], 4), 4, "cpu")
    assert prefill_plan_call(meta, **KW) is None
    dec = decode_plan_call(meta, **KW)
    assert dec.args[0].tolist() == [0, 1, 3] and dec.args[2].tolist() == [1, 4]
    meta = build_metadata([], 16, "cpu")
    assert prefill_plan_call(meta, **KW) is None and decode_plan_call(meta, **KW) is None


def test_prepare_plans_each_wrapper_once_per_step():
    backend = FlashInferBackend(device="cpu", **KW)
    backend.classes[0].prefill, backend.classes[0].decode = RecordingWrapper(), RecordingWrapper()
    meta = build_metadata(spans_for([(0, 9), (5, 1), (6, 1)], 16), 16, "cpu")
    prepared = backend.prepare(meta)
    assert len(backend.classes[0].prefill.plans) == 1 and len(backend.classes[0].decode.plans) == 1
    assert [r.rows for r in prepared.runs] == [slice(0, 9), slice(9, 11)]
    backend.prepare(build_metadata(spans_for([(5, 1)], 16), 16, "cpu"))
    assert len(backend.classes[0].prefill.plans) == 1 and len(backend.classes[0].decode.plans) == 2


def test_empty_step_needs_no_flashinfer():
    backend = FlashInferBackend(device="cpu", **KW)
    prepared = backend.prepare(build_metadata([], 1, "cpu"))   # would import flashinfer if it
    assert backend.classes[0].prefill is None and prepared.runs == []   # tried to build wrappers
    pool = KVPool(1, 4, 1, 2, 64, torch.bfloat16, "cpu")
    out = backend.forward(prepared, 0, torch.zeros(0, 8, 64, dtype=torch.bfloat16),
                          torch.zeros(0, 2, 64, dtype=torch.bfloat16),
                          torch.zeros(0, 2, 64, dtype=torch.bfloat16), pool)
    assert out.shape == (0, 8, 64)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [[(0, 9), (21, 6), (5, 1), (64, 1), (0, 1)],
                                  [(12, 7), (0, 30)], [(3, 1), (40, 1)]],
                         ids=["mixed", "prefill", "decode"])
def test_forward_through_emulated_kernels_equals_dense(page_size, lens):
    kw = dict(KW, dtype=torch.float32, sm_scale=None)
    pool = KVPool(1, 200 // page_size + 10, page_size, 2, 64, torch.float32, "cpu")
    sc = make_scenario(pool, lens, 8, seed=page_size)
    backend = FlashInferBackend(device="cpu", **kw)
    backend.classes[0].prefill = EmulatingWrapper(causal_expected=True)
    backend.classes[0].decode = EmulatingWrapper(causal_expected=False)
    meta = build_metadata(sc.spans, page_size, "cpu")
    out = backend.forward(backend.prepare(meta), 0, sc.q, sc.k, sc.v, pool)
    assert (out.double() - dense_attention(sc)).abs().max() < 2e-5


def test_deterministic_plans_each_query_tile_class_on_its_own_prefill_wrapper():
    backend = FlashInferBackend(device="cpu", **KW, deterministic=True)
    backend.classes[0].tiles = [RecordingWrapper() for _ in range(3)]
    backend.classes[0].prefill = backend.classes[0].tiles[0]
    # group 4: 9 new tokens -> 36 packed rows (class 1); decodes -> 4 (class 0)
    meta = build_metadata(spans_for([(0, 9), (5, 1), (6, 1)], 16), 16, "cpu")
    prepared = backend.prepare(meta)
    small, mid, large = backend.classes[0].tiles
    assert large.plans == [] and len(small.plans) == len(mid.plans) == 1
    (args, kw), = small.plans
    assert args[0].tolist() == [0, 1, 2] and args[3].tolist() == [6, 7]
    (args, kw), = mid.plans
    assert args[0].tolist() == [0, 9] and args[3].tolist() == [9]
    assert kw["fixed_split_size"] == 2048 // 16 and kw["disable_split_kv"] is False
    assert kw["causal"] is True
    assert [r.rows.tolist() for r in prepared.runs] == [[9, 10], list(range(9))]


@pytest.mark.parametrize("lens", [[(0, 9), (21, 6), (5, 1), (64, 1)], [(3, 1), (40, 1)]],
                         ids=["mixed", "decode"])
def test_deterministic_forward_through_emulated_kernel_equals_dense(lens):
    kw = dict(KW, dtype=torch.float32, sm_scale=None)
    pool = KVPool(1, 40, 4, 2, 64, torch.float32, "cpu")
    sc = make_scenario(pool, lens, 8, seed=3)
    backend = FlashInferBackend(device="cpu", **kw, deterministic=True)
    backend.classes[0].tiles = [EmulatingWrapper(causal_expected=True) for _ in range(3)]
    backend.classes[0].prefill = backend.classes[0].tiles[0]
    meta = build_metadata(sc.spans, 4, "cpu")
    out = backend.forward(backend.prepare(meta), 0, sc.q, sc.k, sc.v, pool)
    assert (out.double() - dense_attention(sc)).abs().max() < 2e-5


@pytest.mark.parametrize("new, group, tile_class", [(1, 3, 0), (5, 3, 0), (4, 4, 0),
                                                    (6, 3, 1), (16, 4, 1), (17, 4, 2),
                                                    (1, 32, 1), (3, 32, 2)])
def test_query_tile_class_follows_flashinfers_bounds(new, group, tile_class):
    """FA2DetermineCtaTileQ: packed rows <= 16 -> 16-row tile, <= 64 -> 64, more -> 128."""
    from radixserve.attention.flashinfer_backend import query_tile_class
    assert query_tile_class(new, group) == tile_class


@pytest.mark.parametrize("page_size", [1, 4])
def test_uniform_window_is_planned_as_window_left(page_size):
    """Every layer windowed by W (Mistral): both wrappers are planned with flashinfer's
    window_left = W - 1, and the kernels' documented semantics give dense attention with
    the window mask."""
    kw = dict(KW, dtype=torch.float32, sm_scale=None)
    pool = KVPool(1, 200 // page_size + 10, page_size, 2, 64, torch.float32, "cpu")
    sc = make_scenario(pool, [(0, 30), (21, 6), (5, 1), (64, 1)], 8, seed=page_size)
    backend = FlashInferBackend(device="cpu", **kw, layer_windows=[8, 8])
    backend.classes[0].prefill = EmulatingWrapper(causal_expected=True)
    backend.classes[0].decode = EmulatingWrapper(causal_expected=False)
    out = backend.forward(backend.prepare(build_metadata(sc.spans, page_size, "cpu")), 0,
                          sc.q, sc.k, sc.v, pool)
    for wrapper in (backend.classes[0].prefill, backend.classes[0].decode):
        assert wrapper.plans[-1][1]["window_left"] == 7
    assert (out.double() - dense_attention(sc, window=8)).abs().max() < 2e-5
    assert (dense_attention(sc) - dense_attention(sc, window=8)).abs().max() > 1e-2


def test_mixed_windows_plan_one_wrapper_pair_per_window_class():
    """Gemma-style layers (local W=8, global, local W=8, local W=16): each window class has
    its own wrappers, planned once per step with its window_left (and the soft cap); each
    layer runs its class's and equals dense attention with its own window."""
    windows, page_size = [8, None, 8, 16], 4
    kw = dict(KW, dtype=torch.float32, sm_scale=None)
    pool = KVPool(len(windows), 200 // page_size + 10, page_size, 2, 64, torch.float32, "cpu")
    sc = make_scenario(pool, [(0, 30), (21, 6), (5, 1), (64, 1)], 8, seed=3)
    for layer in range(1, len(windows)):       # the same cached K/V in every layer
        pool.k[layer].copy_(pool.k[0])
        pool.v[layer].copy_(pool.v[0])
    backend = FlashInferBackend(device="cpu", **kw, layer_windows=windows,
                                logits_soft_cap=50.0)
    for c in backend.classes:
        c.prefill, c.decode = EmulatingWrapper(causal_expected=True), \
            EmulatingWrapper(causal_expected=False)
    plan = backend.prepare(build_metadata(sc.spans, page_size, "cpu"))
    assert [c.window_left for c in backend.classes] == [-1, 7, 15]
    for c in backend.classes:
        assert len(c.prefill.plans) == len(c.decode.plans) == 1
        for wrapper in (c.prefill, c.decode):
            planned = wrapper.plans[0][1]
            assert planned.get("window_left", -1) == c.window_left
            assert planned["logits_soft_cap"] == 50.0
    backend.logits_soft_cap = None            # the emulation has no cap: check the windows
    plan = backend.prepare(build_metadata(sc.spans, page_size, "cpu"))
    for layer, w in enumerate(windows):
        out = backend.forward(plan, layer, sc.q, sc.k, sc.v, pool)
        assert (out.double() - dense_attention(sc, window=w)).abs().max() < 2e-5
