"""Cascade (shared-prefix) attention: the grouping, the partial-attention math, and the torch
backend with cascade on, all checked against brute force and dense attention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_helpers import Scenario, dense_attention, slot_of
from radixserve.attention import SeqSpan, TorchAttentionBackend, build_metadata
from radixserve.attention.cascade import CascadeGroup, find_cascade_groups
from radixserve.attention.partial_attention import (attend_with_lse, merge_attention_states,
                                                    softmax_with_lse)
from radixserve.attention.kv_pool import KVPool

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


# --------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Seq:
    blocks: tuple[str, ...]   # shared page blocks the sequence starts with, in order
    private: int              # cached tokens of its own after them
    new: int                  # tokens computed this step


@dataclass(frozen=True)
class Spec:
    blocks: dict[str, int]                          # block name -> pages
    seqs: tuple[Seq, ...]                           # prefill-first
    min_shared_pages: int                           # the backend's threshold, in pages
    expected: tuple[tuple[tuple[int, ...], int], ...]   # (members, shared pages)


def _seq(blocks: str, private: int, new: int) -> Seq:
    return Seq(tuple(blocks.split("+")) if blocks else (), private, new)


SPECS = {
    # Two groups with different shared lengths, members whose cached_len is exactly the
    # shared length, a sequence in no group.
    "decode_groups": Spec(
        {"A": 6, "B": 3},
        (_seq("A", 5, 1), _seq("A", 0, 1), _seq("A", 11, 1), _seq("B", 0, 1), _seq("B", 7, 1),
         _seq("", 10, 1)),
        2, (((0, 1, 2), 6), ((3, 4), 3))),
    "prefill_groups": Spec(
        {"A": 5},
        (_seq("A", 0, 5), _seq("A", 3, 4), _seq("A", 9, 2), _seq("A", 0, 7), _seq("", 6, 1)),
        2, (((0, 1, 2, 3), 5),)),
    # One prefix shared by prefill and decode spans; another by decodes only; loners.
    "mixed": Spec(
        {"A": 4, "B": 3},
        (_seq("A", 0, 6), _seq("", 0, 7), _seq("A", 2, 3), _seq("", 5, 3), _seq("A", 4, 1),
         _seq("B", 1, 1), _seq("A", 0, 1), _seq("B", 0, 1), _seq("", 9, 1)),
        2, (((0, 2, 4, 6), 4), ((5, 7), 3))),
    # A one-page header shared by all, then two long prompts: two groups, not one.
    "nested": Spec(
        {"H": 1, "P": 5, "Q": 4},
        (_seq("H+P", 2, 3), _seq("H+Q", 0, 2), _seq("H+P", 0, 1), _seq("H+Q", 3, 1),
         _seq("H+P", 6, 1), _seq("H", 4, 1)),
        1, (((0, 2, 4), 6), ((1, 3), 5))),
    # Sharing below the threshold: no groups, plain paths.
    "below_threshold": Spec(
        {"A": 2},
        (_seq("A", 3, 4), _seq("A", 0, 1), _seq("A", 5, 1)),
        3, ()),
}


@dataclass
class Built:
    scenario: Scenario
    block_pages: dict[str, np.ndarray]


def build(spec: Spec, pool: KVPool, num_qo_heads: int, seed: int, layer: int = 0) -> Built:
    """Sequences whose leading pages are really shared: one set of page ids (and K/V) per
    block, every other page private; the cached part is written straight into the pool."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ps, hkv, d, dt = pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype
    free = list(rng.permutation(pool.num_pages).astype(np.int32))

    def take(n: int) -> np.ndarray:
        assert n <= len(free), "pool too small for the scenario"
        return np.array([free.pop() for _ in range(n)], dtype=np.int32)

    def randn(n: int, h: int) -> torch.Tensor:
        return torch.randn(n, h, d, generator=gen).to(dt)

    block_pages = {name: take(n) for name, n in spec.blocks.items()}
    block_kv = {name: (randn(n * ps, hkv), randn(n * ps, hkv)) for name, n in spec.blocks.items()}
    spans, full_k, full_v, qs, ks, vs = [], [], [], [], [], []
    for s in spec.seqs:
        head = sum(spec.blocks[b] for b in s.blocks) * ps
        own = s.private + s.new
        extra = -(-(head + own) // ps) - head // ps
        pages = np.concatenate([block_pages[b] for b in s.blocks] + [take(extra)])
        fk = torch.cat([block_kv[b][0] for b in s.blocks] + [randn(own, hkv)])
        fv = torch.cat([block_kv[b][1] for b in s.blocks] + [randn(own, hkv)])
        cached = head + s.private
        for p in range(cached):
            slot = slot_of(pages, p, ps)
            pool.k_flat[layer][slot] = fk[p]
            pool.v_flat[layer][slot] = fv[p]
        spans.append(SeqSpan(pages=pages, cached_len=cached, new_len=s.new))
        full_k.append(fk)
        full_v.append(fv)
        qs.append(randn(s.new, num_qo_heads))
        ks.append(fk[cached:])
        vs.append(fv[cached:])
    sc = Scenario(spans, full_k, full_v, torch.cat(qs), torch.cat(ks), torch.cat(vs))
    return Built(sc, block_pages)


def pool_for(spec: Spec, page_size: int, hkv: int, dtype, head_dim: int = 16,
             layers: int = 1) -> KVPool:
    tokens = sum(n * page_size for n in spec.blocks.values())
    tokens += sum(s.private + s.new + page_size for s in spec.seqs)
    return KVPool(layers, tokens // page_size + 4, page_size, hkv, head_dim, dtype, "cpu")


def run(built: Built, pool: KVPool, heads, min_shared_tokens: int, layer: int = 0,
        **kw) -> tuple[torch.Tensor, object]:
    sc = built.scenario
    backend = TorchAttentionBackend(num_qo_heads=heads[0], num_kv_heads=heads[1],
                                    head_dim=pool.head_dim,
                                    min_shared_tokens=min_shared_tokens, **kw)
    prepared = backend.prepare(build_metadata(sc.spans, pool.page_size, "cpu"))
    return backend.forward(prepared, layer, sc.q, sc.k, sc.v, pool), prepared


def expected_groups(spec: Spec, page_size: int) -> list[CascadeGroup]:
    return [CascadeGroup(members, pages, pages * page_size) for members, pages in spec.expected]


# --------------------------------------------------------------------------- backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cascade_equals_dense(name, heads, page_size, dtype):
    spec = SPECS[name]
    pool = pool_for(spec, page_size, heads[1], dtype)
    built = build(spec, pool, heads[0], seed=page_size + heads[0])
    out, prepared = run(built, pool, heads, spec.min_shared_pages * page_size)
    assert prepared.cascade_groups == expected_groups(spec, page_size)
    assert out.shape == built.scenario.q.shape and out.dtype == dtype
    ref = dense_attention(built.scenario)
    err = (out.double() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"
    # and the plain path (cascade off) agrees with both
    plain, plain_prepared = run(built, pool, heads, spec.min_shared_pages * page_size,
                                cascade=False)
    assert plain_prepared.cascade_groups == [] and not plain_prepared.shared
    assert (plain.double() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmuls", "sdpa"])
@pytest.mark.parametrize("name", ["decode_groups", "prefill_groups", "mixed"])
def test_both_low_precision_kernels_equal_dense(name, sdpa):
    """bf16 cascade parts run torch's fused flash kernel (with its lse) on AMX machines and
    matmuls + softmax elsewhere: both are checked whatever this machine has."""
    spec = SPECS[name]
    pool = pool_for(spec, 4, 2, torch.bfloat16)
    built = build(spec, pool, 6, seed=11)
    out, prepared = run(built, pool, (6, 2), spec.min_shared_pages * 4, sdpa_low_precision=sdpa)
    assert prepared.shared
    err = (out.double() - dense_attention(built.scenario)).abs().max().item()
    assert err < TOL[torch.bfloat16], f"max abs error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_of_decodes_only_when_prefills_stay_out(dtype):
    """cascade_prefills=False (the bf16/fp16 engine setting): prefills keep the plain path."""
    spec = SPECS["mixed"]
    pool = pool_for(spec, 1, 2, dtype)
    built = build(spec, pool, 6, seed=5)
    out, prepared = run(built, pool, (6, 2), spec.min_shared_pages, cascade_prefills=False)
    num_prefills = prepared.meta.num_prefills
    assert num_prefills > 0 and prepared.cascade_groups
    assert all(m >= num_prefills for g in prepared.cascade_groups for m in g.members)
    assert not prepared.rests
    err = (out.double() - dense_attention(built.scenario)).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"


@pytest.mark.parametrize("amx", [False, True])
def test_create_backend_groups_low_precision_prefills_only_on_amx(monkeypatch, amx):
    """bf16 prefills join shared-prefix groups (and use SDPA's fused kernel) only where
    that kernel runs on AMX; fp32 always joins."""
    import radixserve.attention.torch_backend as tb
    from radixserve.attention.backend import create_backend

    monkeypatch.setattr(tb, "cpu_has_amx", lambda: amx)
    kw = dict(num_qo_heads=6, num_kv_heads=2, head_dim=32, device="cpu")
    assert create_backend("torch", dtype=torch.float32, **kw).cascade_prefills
    bf16 = create_backend("torch", dtype=torch.bfloat16, **kw)
    assert bf16.cascade_prefills is amx and bf16.sdpa_low_precision is amx
    # and larger gather chunks in bf16 on every CPU; fp32 keeps the smaller ones
    assert bf16.max_gather_rows == tb.DEFAULT_MAX_GATHER_ELEMS_LOW_PRECISION // 32
    fp32 = create_backend("torch", dtype=torch.float32, **kw)
    assert fp32.max_gather_rows == tb.DEFAULT_MAX_GATHER_ELEMS // 32
    assert tb.DEFAULT_MAX_GATHER_ELEMS_LOW_PRECISION > tb.DEFAULT_MAX_GATHER_ELEMS


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_chunks_equal_one_pass(page_size):
    """Window chunking (gather budget) and row chunking (score budget) change nothing."""
    spec = SPECS["mixed"]
    pool = pool_for(spec, page_size, 2, torch.float32)
    built = build(spec, pool, 6, seed=3)
    whole, _ = run(built, pool, (6, 2), 2 * page_size)
    split, prepared = run(built, pool, (6, 2), 2 * page_size, max_gather_elems=16 * 20,
                          max_score_elems=64)
    assert len(prepared.rests) + len(prepared.shared) > 2
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)


def test_later_layer_and_strided_inputs():
    """Layer index honoured; q/k/v as strided views of a fused qkv projection."""
    spec = SPECS["mixed"]
    pool = pool_for(spec, 4, 2, torch.float32, layers=3)
    built = build(spec, pool, 6, seed=4, layer=2)
    sc = built.scenario
    t = sc.q.shape[0]
    fused = torch.cat([sc.q.reshape(t, -1), sc.k.reshape(t, -1), sc.v.reshape(t, -1)], dim=1)
    q, k, v = fused.split([6 * 16, 2 * 16, 2 * 16], dim=-1)
    q, k, v = q.view(t, 6, 16), k.view(t, 2, 16), v.reshape(t, 2, 16)
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=16,
                                    min_shared_tokens=8)
    prepared = backend.prepare(build_metadata(sc.spans, 4, "cpu"))
    assert prepared.cascade_groups
    out = backend.forward(prepared, 2, q, k, v, pool)
    assert (out.double() - dense_attention(sc)).abs().max() < TOL[torch.float32]
    assert not pool.k[0].any() and not pool.k[1].any()


def test_custom_sm_scale():
    spec = SPECS["decode_groups"]
    pool = pool_for(spec, 4, 2, torch.float32)
    built = build(spec, pool, 4, seed=5)
    out, prepared = run(built, pool, (4, 2), 8, sm_scale=0.05)
    assert prepared.cascade_groups
    assert (out.double() - dense_attention(built.scenario, sm_scale=0.05)).abs().max() < 1e-5


def test_unwritten_nan_slots_do_not_leak():
    """Padding in the window chunks must never read garbage into the output."""
    spec = SPECS["mixed"]
    pool = pool_for(spec, 1, 2, torch.float32)
    built = build(spec, pool, 4, seed=6)
    used = {slot_of(s.pages, p, 1) for s in built.scenario.spans
            for p in range(s.cached_len + s.new_len)}
    free = torch.tensor(sorted(set(range(pool.num_slots)) - used))
    pool.k_flat[0][free] = float("nan")
    pool.v_flat[0][free] = float("nan")
    out, prepared = run(built, pool, (4, 2), 2)
    assert prepared.cascade_groups
    assert torch.isfinite(out).all()
    assert (out.double() - dense_attention(built.scenario)).abs().max() < 1e-5


def test_steps_with_and_without_groups_reuse_the_backend():
    """One backend (and its workspace) across steps of different shapes stays correct."""
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=16,
                                    min_shared_tokens=4)
    for i, name in enumerate(["mixed", "below_threshold", "prefill_groups", "nested"]):
        spec = SPECS[name]
        pool = pool_for(spec, 4, 2, torch.float32)
        sc = build(spec, pool, 6, seed=10 + i).scenario
        prepared = backend.prepare(build_metadata(sc.spans, 4, "cpu"))
        out = backend.forward(prepared, 0, sc.q, sc.k, sc.v, pool)
        assert (out.double() - dense_attention(sc)).abs().max() < 1e-5, name


# --------------------------------------------------------------------------- grouping
def _saved(groups: list[CascadeGroup]) -> int:
    return sum((len(g.members) - 1) * g.shared_pages for g in groups)


def _check_valid(groups, pages, cached, page_size, min_tokens):
    seen = set()
    for g in groups:
        assert len(g.members) >= 2 and g.shared_tokens == g.shared_pages * page_size
        assert g.shared_tokens >= min_tokens
        assert not seen & set(g.members)
        seen |= set(g.members)
        first = pages[g.members[0]][:g.shared_pages]
        for m in g.members:
            assert g.shared_tokens <= cached[m]
            assert np.array_equal(pages[m][:g.shared_pages], first)


def _chain(*runs: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, a + n) for a, n in runs]).astype(np.int32)


def test_grouping_splits_a_short_common_header():
    """64 requests: a 20-page header shared by all, then 8 prompts of 1,000 pages."""
    pages = [_chain((0, 20), (1000 * (1 + i // 8), 1000), (100_000 + 200 * i, 150))
             for i in range(64)]
    groups = find_cascade_groups(pages, [1100] * 64, 1, 64)
    assert [g.members for g in groups] == [tuple(range(8 * k, 8 * k + 8)) for k in range(8)]
    assert {g.shared_pages for g in groups} == {1020}


def test_grouping_keeps_a_pool_beside_a_deeper_group():
    """10 share 100 pages, two of them 1,000: both groups, each at its own length."""
    pages = [_chain((0, 100), (5000 + 2000 * i, 1000)) for i in range(10)]
    pages[3] = pages[7] = _chain((0, 100), (1000, 1000))
    groups = find_cascade_groups(pages, [1100] * 10, 1, 10)
    assert [(g.members, g.shared_pages) for g in groups] == [
        ((0, 1, 2, 4, 5, 6, 8, 9), 100), ((3, 7), 1100)]


def test_grouping_caps_at_whole_cached_pages():
    ps = 16
    pages = [np.arange(10, dtype=np.int32)] * 3
    # cached 37 tokens = 2 whole pages; 160 = 10 pages; 64 = 4 pages
    groups = find_cascade_groups(pages, [37, 160, 64], ps, 32)
    assert [(g.members, g.shared_pages) for g in groups] == [((0, 1, 2), 2)]
    # one whole page below the threshold: the capped member drops out instead
    groups = find_cascade_groups(pages, [37, 160, 64], ps, 48)
    assert [(g.members, g.shared_pages) for g in groups] == [((1, 2), 4)]


def test_grouping_threshold_is_inclusive_and_needs_two_members():
    pages = [np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32),
             np.arange(100, 108, dtype=np.int32)]
    assert find_cascade_groups(pages, [8, 8, 8], 1, 8)[0].members == (0, 1)
    assert find_cascade_groups(pages, [8, 8, 8], 1, 9) == []
    assert find_cascade_groups(pages[:1], [8], 1, 1) == []
    assert find_cascade_groups([], [], 1, 1) == []


@st.composite
def _tries(draw):
    """Page arrays drawn from a small random trie (so real sharing happens)."""
    page_size = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(2, 12))
    next_id = [0]

    def fresh(k):
        next_id[0] += k
        return list(range(next_id[0] - k, next_id[0]))

    roots = [fresh(draw(st.integers(1, 6))) for _ in range(draw(st.integers(1, 3)))]
    pages, cached = [], []
    for _ in range(n):
        path = list(draw(st.sampled_from(roots)))
        for _ in range(draw(st.integers(0, 2))):
            branch = draw(st.integers(0, 1))
            path += fresh(draw(st.integers(1, 5))) if branch else []
        path += fresh(2)                                  # private tail
        pages.append(np.array(path, dtype=np.int32))
        cached.append(draw(st.integers(0, (len(path) - 1) * page_size)))
    return pages, cached, page_size, draw(st.integers(1, 8))


@settings(max_examples=150, deadline=None)
@given(_tries())
def test_grouping_is_valid_and_beats_first_page_buckets(case):
    pages, cached, ps, min_tokens = case
    groups = find_cascade_groups(pages, cached, ps, min_tokens)
    _check_valid(groups, pages, cached, ps, min_tokens)
    # Baseline: bucket by first page, each bucket's common prefix (capped by cached pages).
    baseline = []
    buckets: dict[int, list[int]] = {}
    for b, p in enumerate(pages):
        if cached[b] // ps >= 1:
            buckets.setdefault(int(p[0]), []).append(b)
    for members in buckets.values():
        length = min(cached[b] // ps for b in members)
        for b in members:
            same = np.flatnonzero(pages[b][:length] != pages[members[0]][:length])
            length = min(length, int(same[0]) if len(same) else length)
        if len(members) >= 2 and length * ps >= min_tokens:
            baseline.append(CascadeGroup(tuple(members), length, length * ps))
    assert _saved(groups) >= _saved(baseline)


# --------------------------------------------------------------------------- the math
def test_softmax_with_lse_is_stable_and_exact():
    scores = torch.tensor([[1000.0, 999.0, -5.0], [-1e4, -1e4 + 3, float("-inf")]])
    probs, lse = softmax_with_lse(scores)
    torch.testing.assert_close(lse, torch.logsumexp(scores.double(), -1).float())
    torch.testing.assert_close(probs, scores.softmax(-1))


@pytest.mark.parametrize("mask_rows", [10, 1], ids=["per_row_mask", "key_padding_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_with_lse_matches_float64(dtype, mask_rows):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, r, 8, generator=gen).to(dtype) for r in (10, 7, 7))
    allowed = torch.rand(3, 1, mask_rows, 7, generator=gen) > 0.4
    allowed[..., 0] = True                               # every row sees a key
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    o, lse = attend_with_lse(q, k, v, 0.3, mask, max_score_elems=50)   # several row chunks
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.3 + mask.double()
    ref = s.softmax(-1) @ v.double()
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    assert (o.double() - ref).abs().max() < tol
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < tol


def test_merge_of_two_key_sets_equals_attention_over_both():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 6, 16, generator=gen, dtype=torch.float64).float()
    k, v = (torch.randn(4, 20, 16, generator=gen) for _ in range(2))
    a = attend_with_lse(q, k[:, :13], v[:, :13], 0.25)
    b = attend_with_lse(q, k[:, 13:], v[:, 13:], 0.25)
    whole, _ = attend_with_lse(q, k, v, 0.25)
    tok = lambda t: t.transpose(0, 1)  # noqa: E731  [H, R, ...] -> [R, H, ...]
    merged = merge_attention_states(tok(a[0]), tok(a[1]), tok(b[0]), tok(b[1]))
    torch.testing.assert_close(tok(merged), whole, atol=1e-6, rtol=1e-6)
