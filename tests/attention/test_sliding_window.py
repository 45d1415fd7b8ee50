"""Sliding-window layers in the torch backend equal dense attention with a window mask;
full-attention layers of the same step are unaffected."""

import pytest
import torch

from attn_helpers import dense_attention, make_scenario
from radixserve.attention import TorchAttentionBackend, build_metadata
from radixserve.attention.kv_pool import KVPool

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
