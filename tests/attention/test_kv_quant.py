"""8-bit KV storage: round trips, the pool's codes and scales, and attention over them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_helpers import Scenario, dense_attention, slot_of
from radixserve.attention import SeqSpan, TorchAttentionBackend, build_metadata
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.kv_quant import KVCodec
from radixserve.kv_sizing import KVFormat

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
# Relative round-trip error a format can reach at its largest magnitude: half a code step.
REL_STEP = {"fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3, "int8": 0.5 / 127}


def awkward_kv(seed: int = 0) -> torch.Tensor:
    """[T, H, D] with outliers, tiny heads and an all-zero head."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(50, 3, 64, generator=gen)
    x[:, 1] *= 1e-4
    x[7, 2, 5] = 300.0
    x[9, 0] = 0.0
    return x


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_within_the_format_bound(name):
    codec = KVCodec.of(name)
    x = awkward_kv()
    y = codec.round_trip(x, torch.float32)
    err = (y - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all(err <= codec.error_bound(amax))
    # the documented bound, independent of the code's own formula
    assert torch.all(err <= amax * REL_STEP[name] + 1e-6 * amax)
    assert torch.equal(y[9, 0], torch.zeros(64))            # a zero head stays zero
    assert err.max() > 0                                    # it did quantize


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_in_bf16_adds_only_bf16_rounding(name):
    codec = KVCodec.of(name)
    x = awkward_kv(1)
    y = codec.round_trip(x, torch.bfloat16).float()
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all((y - x).abs() <= codec.error_bound(amax) + amax * 2**-7)


@pytest.mark.parametrize("name", QUANTIZED)
def test_pool_stores_codes_and_scales_and_returns_their_decoding(name):
    pool = KVPool(2, 8, 4, 3, 64, torch.float32, "cpu", kv_format=KVFormat(name, name))
    assert pool.k[0].dtype == KVCodec.of(name).storage and pool.k_scale[1].shape == (8, 4, 3)
    slots = torch.tensor([5, 17, 0])
    k, v = awkward_kv(2)[:3], awkward_kv(3)[:3]
    k_used, v_used = pool.write(1, slots, k, v)
    codec = pool.k_codec
    assert torch.equal(k_used, codec.decode(pool.k_flat[1][slots], pool.k_scale_flat[1][slots],
                                            torch.float32))
    assert torch.equal(v_used, codec.decode(pool.v_flat[1][slots], pool.v_scale_flat[1][slots],
                                            torch.float32))
    assert not torch.equal(k_used, k)
    # decoded=False stores the same bytes and skips decoding them
    again = KVPool(2, 8, 4, 3, 64, torch.float32, "cpu", kv_format=KVFormat(name, name))
    assert again.write(1, slots, k, v, decoded=False) is None
    for a, b in ((again.k[1], pool.k[1]), (again.v_scale[1], pool.v_scale[1])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert pool.bytes_per_token == 2 * 2 * 3 * (64 + 4)
    assert pool.total_bytes == sum(t.numel() * t.element_size()
                                   for t in pool.k + pool.v + pool.k_scale + pool.v_scale)


def test_mixed_k16_v8_pool():
    pool = KVPool(1, 4, 2, 3, 64, torch.bfloat16, "cpu",
                  kv_format=KVFormat("bfloat16", "fp8_e4m3"))
    assert pool.k_scale is None and pool.v_scale is not None
    k, v = awkward_kv(4)[:2].bfloat16(), awkward_kv(5)[:2].bfloat16()
    k_used, v_used = pool.write(0, torch.tensor([1, 6]), k, v)
    assert torch.equal(k_used, k) and torch.equal(pool.k_flat[0][6], k[1])
    assert not torch.equal(v_used, v)
    assert pool.bytes_per_token == 3 * (64 * 2 + 64 + 4)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_full_page_never_changes_after_later_writes(name):
    """A page filled over several steps, then later tokens of much larger magnitude written
    next to it and a copy-on-write out of it: its codes and scales stay bit-identical."""
    pool = KVPool(1, 6, 4, 3, 64, torch.float32, "cpu", kv_format=KVFormat(name, name))
    gen = torch.Generator().manual_seed(0)
    page = 2
    for pos in range(4):                                    # one token per step
        pool.write(0, torch.tensor([page * 4 + pos]), *torch.randn(2, 1, 3, 64, generator=gen))
    frozen = [t[page].clone() for t in (pool.k[0], pool.v[0], pool.k_scale[0], pool.v_scale[0])]
    big = torch.randn(2, 8, 3, 64, generator=gen) * 1000    # the next page, and another
    pool.write(0, torch.arange(12, 20), big[0], big[1])
    pool.copy_prefix(page, 5, 3)                            # copy-on-write of its prefix
    pool.write(0, torch.tensor([5 * 4 + 3]), big[0, :1], big[1, :1])
    after = [t[page] for t in (pool.k[0], pool.v[0], pool.k_scale[0], pool.v_scale[0])]
    for a, b in zip(frozen, after):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # the copy carries the scales: the copied tokens decode to the same values
    c = pool.k_codec
    src = c.decode(pool.k[0][page, :3], pool.k_scale[0][page, :3], torch.float32)
    dst = c.decode(pool.k[0][5, :3], pool.k_scale[0][5, :3], torch.float32)
    assert torch.equal(src, dst)


# ---- attention over quantized pages equals attention over their decoded values ----------

def shared_prefix_scenario(page_size: int, hq: int, hkv: int, d: int, seed: int):
    """Spans whose first pages are one shared prefix (cascade groups form), plus others."""
    gen = torch.Generator().manual_seed(seed)
    shared_tokens = 80
    shared = np.arange(shared_tokens // page_size, dtype=np.int32)
    nxt = len(shared)
    prefix_k = torch.randn(shared_tokens, hkv, d, generator=gen)
    prefix_v = torch.randn(shared_tokens, hkv, d, generator=gen)
    lens = [(100, 5), (90, 3), (0, 7), (95, 1), (88, 1), (130, 1), (3, 1)]
    spans, full_k, full_v = [], [], []
    for i, (cached, new) in enumerate(lens):
        n_pages = -(-(cached + new) // page_size)
        sharing = cached >= shared_tokens
        own = n_pages - (len(shared) if sharing else 0)
        pages = np.concatenate([shared if sharing else shared[:0],
                                np.arange(nxt, nxt + own, dtype=np.int32)])
        nxt += own
        fk = torch.randn(cached + new, hkv, d, generator=gen)
        fv = torch.randn(cached + new, hkv, d, generator=gen)
        if sharing:
            fk[:shared_tokens], fv[:shared_tokens] = prefix_k, prefix_v
        spans.append(SeqSpan(pages, cached, new))
        full_k.append(fk)
        full_v.append(fv)
    q = torch.randn(sum(n for _, n in lens), hq, d, generator=gen)
    k = torch.cat([fk[s.cached_len:] for s, fk in zip(spans, full_k)])
    v = torch.cat([fv[s.cached_len:] for s, fv in zip(spans, full_v)])
    return Scenario(spans, full_k, full_v, q, k, v), nxt


def write_cached(pool: KVPool, sc: Scenario) -> None:
    for s, fk, fv in zip(sc.spans, sc.full_k, sc.full_v):
        slots = torch.tensor([slot_of(s.pages, p, pool.page_size) for p in range(s.cached_len)],
                             dtype=torch.long)
        pool.write(0, slots, fk[:s.cached_len], fv[:s.cached_len])


def decoded_pool(pool: KVPool, dtype: torch.dtype = torch.float32) -> KVPool:
    """A pool holding what the quantized pool's pages decode to (exactly, in fp32)."""
    ref = KVPool(1, pool.num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim,
                 dtype, "cpu")
    for name in "kv":
        codec, data, scales = pool.side(name, 0)
        values = data.to(dtype) if scales is None else codec.decode(data, scales, dtype)
        getattr(ref, f"{name}_flat")[0].copy_(values)
    return ref


@pytest.mark.parametrize("fmt", [("fp8_e4m3",) * 2, ("fp8_e5m2",) * 2, ("int8",) * 2,
                                 ("float32", "fp8_e4m3")], ids="/".join)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_paged_attention_on_quantized_kv_equals_it_on_decoded_kv(fmt, page_size, heads):
    hq, hkv, d = *heads, 64
    sc, pages_used = shared_prefix_scenario(page_size, hq, hkv, d, seed=page_size)
    qpool = KVPool(1, pages_used + 2, page_size, hkv, d, torch.float32, "cpu",
                   kv_format=KVFormat(*fmt))
    write_cached(qpool, sc)
    ref_pool = decoded_pool(qpool)
    backend = TorchAttentionBackend(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    meta = build_metadata(sc.spans, page_size, "cpu")
    prepared = backend.prepare(meta)
    assert prepared.shared, "the scenario must exercise the shared-prefix (cascade) path"
    out = backend.forward(prepared, 0, sc.q, sc.k, sc.v, qpool)
    # the reference gets the new tokens as the quantized pool decodes them
    k_new = decoded_pool(qpool).k_flat[0][meta.write_slots]
    v_new = decoded_pool(qpool).v_flat[0][meta.write_slots]
    ref_backend = TorchAttentionBackend(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    ref = ref_backend.forward(ref_backend.prepare(meta), 0, sc.q, k_new, v_new, ref_pool)
    # Prefill tokens read the decoded values: bit for bit the same. Decode tokens fold the
    # scales into scores and probabilities (quant_decode): the same sums rounded in another
    # order, so equal within a few fp32 ulps of these O(1) outputs.
    starts = meta.qo_indptr[:-1].numpy()
    decodes = torch.tensor([starts[i] for i, s in enumerate(sc.spans) if s.new_len == 1])
    prefills = torch.tensor([t for t in range(len(sc.q)) if t not in set(decodes.tolist())])
    assert len(decodes) and len(prefills)
    assert torch.equal(out[prefills], ref[prefills])
    decode_err = (out[decodes] - ref[decodes]).abs().max().item()
    assert decode_err < 2e-6
    # and both match dense attention over the decoded K/V
    err = (out.double() - dense_over_decoded(qpool, sc)).abs().max().item()
    assert err < 2e-5


def dense_over_decoded(qpool: KVPool, sc: Scenario) -> torch.Tensor:
    """float64 attention of sc.q over what qpool's pages (new tokens included) decode to."""
    dec = decoded_pool(qpool)
    seq = [[slot_of(s.pages, p, qpool.page_size) for p in range(s.cached_len + s.new_len)]
           for s in sc.spans]
    return dense_attention(Scenario(sc.spans, [dec.k_flat[0][i] for i in seq],
                                    [dec.v_flat[0][i] for i in seq], sc.q, sc.k, sc.v))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_decode_in_low_precision_is_as_accurate_as_decoding(name, dtype):
    """bf16 compute: the fp8 bit move leaves codes as tiny floats (value * 2^-120) that
    the folded decode lifts back; fp16 compute does not fold (unscaled e5m2 codes would
    overflow its q . k). Against float64 attention over the decoded K/V (magnitudes up to
    ~100), either must be as accurate as the same backend reading those decoded values
    from a pool in the compute dtype (the per-element decode's numerics)."""
    sc, pages_used = shared_prefix_scenario(4, 6, 2, 64, seed=7)
    sc.full_k = [fk * 30 for fk in sc.full_k]
    sc.full_v = [fv * 30 for fv in sc.full_v]
    qpool = KVPool(1, pages_used + 2, 4, 2, 64, dtype, "cpu", kv_format=KVFormat(name, name))
    write_cached(qpool, sc)
    q = (sc.q * 0.2).to(dtype)
    k = torch.cat([fk[s.cached_len:] for s, fk in zip(sc.spans, sc.full_k)]).to(dtype)
    v = torch.cat([fv[s.cached_len:] for s, fv in zip(sc.spans, sc.full_v)]).to(dtype)
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=64)
    meta = build_metadata(sc.spans, 4, "cpu")
    out = backend.forward(backend.prepare(meta), 0, q, k, v, qpool)
    plain_pool = decoded_pool(qpool, dtype)
    k_new, v_new = (getattr(plain_pool, f"{n}_flat")[0][meta.write_slots] for n in "kv")
    plain = backend.forward(backend.prepare(meta), 0, q, k_new, v_new, plain_pool)
    ref = dense_over_decoded(qpool, Scenario(sc.spans, sc.full_k, sc.full_v, q, k, v))
    scale = ref.abs().amax(-1, keepdim=True)
    err_folded = ((out.double() - ref).abs() / scale).max().item()
    err_plain = ((plain.double() - ref).abs() / scale).max().item()
    assert torch.isfinite(out).all() and err_folded > 0
    assert err_folded <= 1.5 * err_plain + 1e-3, (err_folded, err_plain)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_decode_by_bits_equals_torch_casts_for_every_code(name, dtype):
    """The CPU decode moves bits instead of casting; it must equal cast-then-scale exactly,
    for all 256 codes (subnormals and signed zeros included)."""
    codec = KVCodec.of(name)
    codes = torch.arange(256, dtype=torch.uint8).view(codec.storage)
    finite = torch.isfinite(codes.float())
    codes = codes[finite].reshape(-1, 1).expand(-1, 8).contiguous()
    scales = torch.rand(codes.shape[0], generator=torch.Generator().manual_seed(0)) * 4
    got = codec.decode(codes, scales, dtype)
    ref = codes.to(dtype) * scales.to(dtype).unsqueeze(-1)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)) or torch.equal(got, ref)
