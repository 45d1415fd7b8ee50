"""Pre-packed linears (model/packed_linear.py): the same bits as F.linear, and never stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model.packed_linear import Linear, packing_available

needs_packing = pytest.mark.skipif(
    not packing_available(torch.empty(1, dtype=torch.bfloat16)),
    reason="this torch build has no oneDNN linear packing")


def _layer(dtype: torch.dtype, bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias).to(dtype)
    assert layer.repack() == packing_available(layer.weight)
    return layer


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 32, 64, 300, 1500])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_bf16_equals_f_linear(rows, bias):
    """Bit for bit up to 32 rows; above, oneDNN's packed kernel may round differently from
    the one F.linear picks (1 ulp), and above 1,024 rows F.linear runs itself."""
    layer = _layer(torch.bfloat16, bias)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
    want = F.linear(x, layer.weight, layer.bias)
    if rows <= 32 or rows > 1024:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)   # 1 bf16 ulp


@needs_packing
def test_a_changed_weight_is_not_served_from_the_stale_packing():
    layer = _layer(torch.bfloat16)
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(2)                     # in place: the version counter moves
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.weight = torch.nn.Parameter(torch.randn(160, 96).to(torch.bfloat16))   # replaced
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_float32_does_not_pack():
    layer = _layer(torch.float32)
    assert not layer.repack()
    x = torch.randn(3, 96)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_packing
def test_loaded_bf16_model_runs_packed(model_bf16):
    packed = [m for m in model_bf16.model.modules() if isinstance(m, Linear)]
    assert packed and all(m._packed is not None and m._fresh() for m in packed)


@pytest.mark.skipif(not packing_available(torch.empty(1, dtype=torch.float16)),
                    reason="no oneDNN fp16 on this CPU")
def test_float16_packs_and_matches():
    layer = _layer(torch.float16)
    x = torch.randn(5, 96).to(torch.float16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
