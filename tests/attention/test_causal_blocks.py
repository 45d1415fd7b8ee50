"""Blocked causal attention (the bf16/fp16 CPU prefill path) equals fp32 dense attention."""

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.causal_blocks import causal_attention_blocked


def dense(q, k, v, scale):
    """fp32 reference: query i of n sees keys 0..kv_len - n + i."""
    n, hq, _ = q.shape
    kv_len = k.shape[1]
    group = hq // k.shape[0]
    kf = k.double().repeat_interleave(group, 0)
    vf = v.double().repeat_interleave(group, 0)
    mask = torch.ones(n, kv_len, dtype=torch.bool).tril(kv_len - n)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), kf, vf, attn_mask=mask,
                                       scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("n,kv_len,block", [(50, 50, 16), (33, 80, 16), (16, 16, 16),
                                            (7, 7, 16), (40, 41, 128)])
def test_blocked_equals_dense(n, kv_len, block, heads, dtype, tol):
    torch.manual_seed(n * 100 + kv_len)
    hq, hkv = heads
    q = torch.randn(n, hq, 64, dtype=dtype)
    # Token-major K/V seen head-major through a transpose, as the backend passes them.
    k = torch.randn(kv_len, hkv, 64, dtype=dtype).transpose(0, 1)
    v = torch.randn(kv_len, hkv, 64, dtype=dtype).transpose(0, 1)
    out = torch.full_like(q, float("nan"))
    got = causal_attention_blocked(q, k, v, 0.125, out, block=block)
    assert got is out
    err = (out.double() - dense(q, k, v, 0.125)).abs().max().item()
    assert err < tol, f"max abs error {err}"
