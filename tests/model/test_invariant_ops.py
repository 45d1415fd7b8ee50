"""Deterministic mode's building blocks are row-invariant: a row's result is bit-identical
whatever other rows are computed with it (linear layers, norms, RoPE, activations,
sampling), at 1, 2 and 3 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.invariant_ops import (RowBlocks, RowInvariantLinear, blocked_linear,
                                            choose_row_blocks, native_bf16_cpu,
                                            row_invariant_model)
from radixserve.model.llama import RMSNorm
from radixserve.model.packed_linear import Linear
from radixserve.model.rope import apply_rotary

# SmolLM2-135M's linear shapes (out, in): fused qkv, o, fused gate/up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROW_COUNTS = [1, 2, 3, 7, 31, 32, 33, 64, 100, 300, 700, 1024, 1100, 1611, 2048, 2100]
# bf16 only where its GEMMs are native (AVX512-BF16/AMX): elsewhere deterministic mode
# refuses bf16 linears (invariant_ops.deterministic_dtype_error), so nothing is promised.
NATIVE_BF16 = native_bf16_cpu()
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              not NATIVE_BF16, reason="CPU without AVX512-BF16/AMX: bf16 refused")),
          torch.float16]


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def rows_alone(f, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([f(x[i:i + 1]) for i in range(x.shape[0])])


def linear_layer(w: torch.Tensor, packed: bool) -> nn.Linear:
    """An nn.Linear holding ``w``, or the model's pre-packed Linear (packed_linear)."""
    layer = (Linear if packed else nn.Linear)(w.shape[1], w.shape[0], bias=False,
                                              dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    if packed:
        layer.repack()
    return layer


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_row_invariant(dtype, shape, packed, threads):
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=g) * 0.05).to(dtype)
    x = torch.randn(max(ROW_COUNTS), shape[1], generator=g).to(dtype)
    layer = linear_layer(w, packed)
    blocks = choose_row_blocks(layer)   # what deterministic mode uses at this thread count
    first = rows_alone(lambda r: blocked_linear(r, layer, blocks), x[:40])
    for n in ROW_COUNTS:
        got = blocked_linear(x[:n], layer, blocks)
        assert torch.equal(got[:40], first[:n]), n
        # the same rows at another offset (other neighbours, other place in a block)
        shifted = blocked_linear(x[5:5 + n], layer, blocks)
        assert torch.equal(shifted[:35], first[5:5 + min(n, 35)]), n


@pytest.mark.skipif(not NATIVE_BF16, reason="CPU without AVX512-BF16/AMX: bf16 refused")
def test_plain_linear_is_not_row_invariant_in_bf16():
    """Why RowBlocks exists: oneDNN's bf16 matmul changes some rows between M=1 and M=64
    (when this stops failing on some machine, the blocks are merely unneeded there)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3072, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(64, 576, generator=g).bfloat16()
    if torch.equal(F.linear(x, w), rows_alone(lambda r: F.linear(r, w), x)):
        pytest.skip("this machine's bf16 matmul is row-invariant at M=64 already")
    assert torch.equal(blocked_linear(x, linear_layer(w, False),
                                      RowBlocks.for_dtype(torch.bfloat16)),
                       rows_alone(lambda r: F.linear(r, w), x))


def test_row_blocks_cover_rows_once():
    b = RowBlocks()
    for rows in (1, 31, 32, 33, 255, 256, 1023, 1024, 1025, 1300, 2048, 2300):
        blocks = b.blocks(rows)
        starts = [s for s, _, _ in blocks]
        assert starts == sorted(starts)
        assert sum(n for _, n, _ in blocks) == rows
        assert all(call in b.big_rows or call == max(n, b.min_rows)
                   for _, n, call in blocks)
        assert all(call >= n for _, n, call in blocks)
    # a full prefill step is one 2,048-row call; a rest past 1,024 one padded 2,048 tile
    assert b.blocks(2048) == [(0, 2048, 2048)]
    assert b.blocks(1711) == [(0, 1711, 2048)]
    assert b.blocks(4100) == [(0, 2048, 2048), (2048, 2048, 2048), (4096, 4, 4)]
    assert b.blocks(505) == [(0, 505, 1024)]
    assert RowBlocks(big_rows=(1024,)).blocks(2100)[:2] == [(0, 1024, 1024), (1024, 1024, 1024)]


def test_row_invariant_model_shares_weights_and_leaves_model_alone():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.float16)
    inv = row_invariant_model(model)
    assert isinstance(inv[0], RowInvariantLinear) and isinstance(model[0], nn.Linear)
    assert inv[0].weight is model[0].weight
    x = torch.randn(5, 8).half()
    assert torch.equal(inv(x), model(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])   # no GEMM: every CPU
def test_norm_rope_activation_row_invariant(dtype, threads):
    g = torch.Generator().manual_seed(1)
    n, hidden = 2100, 576
    h = torch.randn(n, hidden, generator=g).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    pos = torch.randint(0, 8000, (n,), generator=g)
    freqs = torch.outer(pos.float(), torch.rand(32, generator=g))
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    gate_up = torch.randn(n, 3072, generator=g).to(dtype)

    def act(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    with torch.no_grad():
        for f, x in ((norm, h), (act, gate_up)):
            full = f(x)
            for m in (1, 3, 17, 100, 999):
                assert torch.equal(f(x[:m]), full[:m])
                assert torch.equal(f(x[m:m + 40]), full[m:m + 40])
        full = apply_rotary(q, cos, sin)
        for m in (1, 3, 17, 100, 999):
            assert torch.equal(apply_rotary(q[m:m + 40], cos[m:m + 40], sin[m:m + 40]),
                               full[m:m + 40])


def test_sampler_row_invariant():
    """A seeded row's token depends on its logits, params and generator only."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 49152, generator=g) * 4
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=i)
              for i, (t, p, k) in enumerate([(0.0, 1.0, -1), (0.7, 0.9, -1), (1.0, 1.0, 50),
                                             (1.3, 0.5, 20)] * 3)]

    def gens(rows):
        return [None if params[i].temperature == 0 else
                torch.Generator().manual_seed(1000 + i) for i in rows]

    sampler = Sampler()
    everything = sampler.sample(logits, params, gens(range(12))).token_ids
    for i in range(12):
        alone = sampler.sample(logits[i:i + 1], [params[i]], gens([i])).token_ids
        assert alone == [everything[i]]
    tail = sampler.sample(logits[5:], params[5:], gens(range(5, 12))).token_ids
    assert tail == everything[5:]


@pytest.mark.skipif(NATIVE_BF16, reason="this CPU computes bf16 natively")
def test_bf16_linears_refused_without_native_bf16():
    model = nn.Sequential(nn.Linear(8, 16)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX"):
        row_invariant_model(model)
