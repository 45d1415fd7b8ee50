"""RoPE rotated in place (the model's path) equals the out-of-place rotation bit for bit."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.rope import apply_rotary, rotate_in_place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_place_on_a_fused_projection_view_equals_apply_rotary(dtype):
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 13, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    angles = torch.rand(t, 1, d // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert not torch.equal(expected_q, q)                        # the rotation does something
    v_before = qkv[:, (hq + hkv) * d:].clone()
    rotate_in_place(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)      # v untouched
