"""Sliding-window layers in the torch backend equal dense attention with a window mask;
full-attention layers of the same step are unaffected."""

import numpy as np
import pytest
import torch

from attn_helpers import dense_attention, make_scenario
from radixserve.attention import TorchAttentionBackend, build_metadata
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.spans import SeqSpan
from radixserve.attention.window_kv import WindowedKV

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

# (cached_len, new_len) per sequence: prefills from scratch and over a cached prefix,
# decodes inside and far past the window, a mixed step.
SCENARIOS = {
    "prefills": [(0, 5), (0, 40), (30, 9), (7, 33)],
    "decodes": [(3, 1), (40, 1), (16, 1), (15, 1), (90, 1)],
    "mixed": [(0, 20), (21, 6), (5, 1), (64, 1)],
}
LAYER_WINDOWS = [16, None]      # layer 0 windowed, layer 1 full, as a hybrid model


@pytest.mark.parametrize("dtype, sdpa", [(torch.float32, None), (torch.bfloat16, False),
                                         (torch.bfloat16, True)],
                         ids=["fp32", "bf16-blocked", "bf16-sdpa"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_windowed_layer_equals_masked_dense(scenario, page_size, dtype, sdpa):
    pool = KVPool(2, 400 // page_size + 8, page_size, 2, 32, dtype, "cpu")
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=32,
                                    layer_windows=LAYER_WINDOWS,
                                    sdpa_low_precision=sdpa)
    lens = SCENARIOS[scenario]
    for layer, window in enumerate(LAYER_WINDOWS):
        sc = make_scenario(pool, lens, 6, seed=page_size + layer, layer=layer)
        meta = build_metadata(sc.spans, page_size, "cpu")
        out = backend.forward(backend.prepare(meta), layer, sc.q, sc.k, sc.v, pool)
        ref = dense_attention(sc, window=window)
        err = (out.double() - ref).abs().max().item()
        assert err < TOL[dtype], f"layer {layer} (window {window}): max abs error {err}"
        if window is not None:       # the window does cut something in this scenario
            assert (dense_attention(sc) - ref).abs().max().item() > 10 * TOL[dtype]


def test_short_steps_reuse_the_full_plan():
    """No sequence longer than the window: the windowed layers share the full plan."""
    pool = KVPool(2, 64, 1, 2, 32, torch.float32, "cpu")
    backend = TorchAttentionBackend(num_qo_heads=4, num_kv_heads=2, head_dim=32,
                                    layer_windows=LAYER_WINDOWS)
    sc = make_scenario(pool, [(0, 9), (6, 1)], 4)
    plan = backend.prepare(build_metadata(sc.spans, 1, "cpu"))
    assert plan.by_window[16] is plan


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_windowed_pool_reads_only_kept_pages(scenario, page_size):
    """Per-group pools: the windowed layer reads a page table that holds real pages only
    from each sequence's first kept page on (the rest map to the all-zero null page), and
    still equals dense attention with the window mask."""
    window, lens = 16, SCENARIOS[scenario]
    ids = KVPool(1, 400 // page_size + 8, page_size, 2, 32, torch.float32, "cpu")
    sc = make_scenario(ids, lens, 6, seed=7 + page_size)      # full page ids and their KV
    win_pool = KVPool(1, 400 // page_size + 9, page_size, 2, 32, torch.float32, "cpu")
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=32,
                                    layer_windows=[window])
    kv = WindowedKV(win_pool, backend, window)
    of_page = np.full(ids.num_pages, kv.null, dtype=np.int32)
    free = iter(np.random.default_rng(page_size).permutation(kv.null))
    dropped = 0
    for span in sc.spans:
        first_kept = max(0, span.cached_len - window + 1) // page_size
        dropped += first_kept
        for p in span.pages[first_kept:]:
            of_page[p] = next(free)
            win_pool.k[0][of_page[p]] = ids.k[0][p]
            win_pool.v[0][of_page[p]] = ids.v[0][p]
    kv.attach(of_page)
    step = kv.prepare(sc.spans, page_size, torch.device("cpu"))
    out = backend.forward(step.plan, 0, sc.q, sc.k, sc.v, step.kv_pool)
    err = (out.double() - dense_attention(sc, window=window)).abs().max().item()
    assert err < TOL[torch.float32], f"max abs error {err}"
    assert dropped > 0 and win_pool.k[0][kv.null].abs().max() == 0      # null never written


def test_windowed_pool_refuses_to_write_without_a_page():
    pool = KVPool(1, 5, 4, 2, 32, torch.float32, "cpu")
    kv = WindowedKV(pool, TorchAttentionBackend(num_qo_heads=2, num_kv_heads=2, head_dim=32,
                                                layer_windows=[8]), 8)
    kv.attach(np.array([0, kv.null, 1], dtype=np.int32))
    with pytest.raises(RuntimeError, match="no windowed page"):
        kv.spans([SeqSpan(np.array([0, 1, 2], dtype=np.int32), 4, 3)], 4)


def test_windowed_page_table_as_flashinfer_reads_it():
    """The window pool's metadata (what flashinfer's paged wrappers are planned with): the
    same lengths and page counts as the full table, every page id mapped through `of_page`,
    the pages before a window on the null page, the null page never written to."""
    page_size, window = 4, 8
    pool = KVPool(1, 9, page_size, 2, 32, torch.float32, "cpu")
    kv = WindowedKV(pool, TorchAttentionBackend(num_qo_heads=2, num_kv_heads=2, head_dim=32,
                                                layer_windows=[window]), window)
    of_page = np.full(12, kv.null, dtype=np.int32)
    of_page[[3, 4, 5, 9, 10]] = [0, 1, 2, 5, 6]          # the pages the leases hold
    kv.attach(of_page)
    spans = [SeqSpan(np.array([7, 8, 3, 4, 5], dtype=np.int32), 10, 9),   # prefill, cached
             SeqSpan(np.array([11, 9, 10], dtype=np.int32), 9, 1)]        # decode
    full = build_metadata(spans, page_size, "cpu")
    win = build_metadata(kv.spans(spans, page_size), page_size, "cpu")
    for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
        assert torch.equal(getattr(win, name), getattr(full, name)), name
    assert win.kv_indices.tolist() == [kv.null, kv.null, 0, 1, 2, kv.null, 5, 6]
    assert kv.null not in (win.write_slots // page_size).tolist()
    assert (win.write_slots % page_size).tolist() == (full.write_slots % page_size).tolist()
