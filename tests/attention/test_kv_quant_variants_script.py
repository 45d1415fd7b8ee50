"""scripts/kv_quant_variants.py rounds K/V as the alternatives it measures would: check the
roundings its figures in docs/benchmarks.md rest on against the shipped codec."""

import importlib.util
from pathlib import Path

import pytest
import torch

from radixserve.attention.kv_quant import KVCodec

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kv_quant_variants.py"


@pytest.fixture(scope="module")
def variants():
    spec = importlib.util.spec_from_file_location("kv_quant_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample() -> torch.Tensor:
    x = torch.randn(40, 3, 64, generator=torch.Generator().manual_seed(0))
    x[:, :, 5] *= 20                                   # an outlier channel
    return x


def test_hadamard_is_orthonormal(variants):
    h = variants.hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)


def test_amax_variants_round_like_the_shipped_codec(variants):
    x = sample()
    assert torch.equal(variants.rounding("int8")(x), KVCodec.of("int8").round_trip(x, x.dtype))
    # fp8: the same but for the codec's flush of values below the smallest normal code
    fp8 = KVCodec.of("fp8_e4m3")
    diff = (variants.rounding("fp8")(x) - fp8.round_trip(x, x.dtype)).abs()
    scale = x.abs().amax(-1, keepdim=True) / fp8.max_code
    assert torch.all(diff <= scale * 2**-6)


@pytest.mark.parametrize("fmt, codec", [("fp8", "fp8_e4m3"), ("int8", "int8")])
def test_rotated_rounding_is_rounding_in_the_rotated_basis(variants, fmt, codec):
    x = sample()
    h = variants.hadamard(64)
    y = variants.rounding(fmt, rotate=True)(x)
    err = ((y - x) @ h).abs()                          # the error where it was made
    rotated_amax = (x @ h).abs().amax(-1, keepdim=True)
    assert torch.all(err <= KVCodec.of(codec).error_bound(rotated_amax) + 1e-5)
    assert err.max() > 0
    # the outlier channel makes int8's error larger unrotated
    if fmt == "int8":
        assert (y - x).pow(2).sum() < (variants.rounding("int8")(x) - x).pow(2).sum()
