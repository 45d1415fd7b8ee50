"""The roofline arithmetic against numbers worked out by hand for a toy model.

Toy shape: 2 layers, hidden 4, 2 heads / 1 KV head of dim 2, MLP 8, vocab 10. One layer's
linears: q/k/v 4 x (4 + 2 + 2) = 32, o 4 x 4 = 16, gate/up/down 3 x 4 x 8 = 96: 144 weights;
288 in the body, 40 in the LM head.
"""

from __future__ import annotations

import pytest

from radixserve.perf.roofline import (MachinePeaks, ModelShape, SharedPromptWorkload,
                                      StepCost, attention_flops, weighted_gflops,
                                      workload_floor)

TOY = ModelShape(num_layers=2, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                 intermediate_size=8, vocab_size=10)


def test_weights_and_linear_flops():
    assert TOY.layer_weights == 144
    assert TOY.body_weights == 288 and TOY.head_weights == 40
    # 3 tokens through the body, 1 through the head: 2 * (3 * 288 + 40)
    assert TOY.linear_flops(3, 1) == 1808
    # K and V, 2 layers, 1 head of 2 elements, 2 bytes each
    assert TOY.kv_bytes_per_token(2) == 16
    assert TOY.gemm_shapes() == {"qkv": (4, 8), "o": (4, 4), "gate_up": (4, 16),
                                 "down": (8, 4), "lm_head": (4, 10)}


def test_attention_flops_counts_causal_pairs():
    # 2 new queries after 3 cached tokens see 4 and 5 keys: 9 pairs x 4 x 2 layers x 2 heads
    # x dim 2 = 288
    assert attention_flops(TOY, 2, 5) == 288
    # a fresh 4-token prompt: 1 + 2 + 3 + 4 = 10 pairs
    assert attention_flops(TOY, 4, 4) == 320


WORK = dict(groups=2, per_group=2, system=4, question=2, output=3)
# prefill_gflops 1e-6: 1,000 FLOPs a second; bandwidth 1e-7 GB/s: 100 bytes a second.
PEAKS = MachinePeaks(decode_gflops=1e-6, prefill_gflops=1e-6, bandwidth_gbs=1e-7)


def test_floor_cache_on_by_hand():
    f = workload_floor(TOY, PEAKS, SharedPromptWorkload(**WORK, cache=True))
    # 2 system prompts + 4 questions = 16 tokens, 4 sampled: 2 * (16 * 288 + 4 * 40) = 9,536;
    # attention: 2 x 320 (prompts) + 4 x 352 (2 queries after 4 cached: 11 pairs) = 2,048
    assert f.prefill.flops == 11584
    assert f.prefill_s == pytest.approx(11.584)
    # 2 decode steps (the first token comes from the prefill); weights (288 + 40) x 2 bytes
    # = 656. Step 1: contexts of 7, the 2 prompts read once: 8 + 4 x 3 = 20 tokens x 16 B;
    # step 2: 8 + 4 x 4 = 24 tokens.
    assert [s.bytes for s in f.decode_steps] == [656 + 320, 656 + 384]
    # FLOPs: 2 * 4 * (288 + 40) = 2,624 + 4 queries x 7 (then 8) keys x 32
    assert [s.flops for s in f.decode_steps] == [2624 + 896, 2624 + 1024]
    # memory-bound at 100 B/s: 9.76 s + 10.40 s
    assert f.decode_s == pytest.approx(20.16)
    assert f.total_s == pytest.approx(31.744)


def test_floor_cache_off_by_hand():
    f = workload_floor(TOY, PEAKS, SharedPromptWorkload(**WORK, cache=False))
    # 4 requests x 6 tokens: 2 * (24 * 288 + 4 * 40) + 4 x (21 pairs x 32)
    assert f.prefill.flops == 14144 + 2688
    # no shared pages: every request reads its whole context (7, then 8 tokens)
    assert [s.bytes for s in f.decode_steps] == [656 + 4 * 7 * 16, 656 + 4 * 8 * 16]


def test_step_takes_the_slower_of_compute_and_memory():
    step = StepCost(flops=2e9, bytes=1e9)
    assert step.seconds(gflops=1.0, gbs=1.0) == pytest.approx(2.0)     # compute-bound
    assert step.seconds(gflops=4.0, gbs=0.5) == pytest.approx(2.0)     # memory-bound


def test_weighted_rate_is_total_flops_over_total_time():
    # 1 GFLOP at 1 GFLOP/s (1 s) and 3 GFLOP at 3 GFLOP/s (1 s): 4 GFLOP in 2 s
    assert weighted_gflops([(1e9, 1.0), (3e9, 3.0)]) == pytest.approx(2.0)


def test_cache_on_and_off_are_the_two_workloads():
    from radixserve.perf.roofline import cache_on_and_off
    both = cache_on_and_off(TOY, PEAKS, dtype_bytes=2, **WORK)
    assert both["on"].total_s == pytest.approx(31.744)
    off = workload_floor(TOY, PEAKS, SharedPromptWorkload(**WORK, cache=False))
    assert both["off"].total_s == pytest.approx(off.total_s)
