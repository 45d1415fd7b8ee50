"""The torch paged-attention backend equals dense attention on contiguous K/V."""

import numpy as np
import pytest
import torch

from attn_helpers import dense_attention, make_scenario, slot_of
from radixserve.attention import SeqSpan, TorchAttentionBackend, build_metadata
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_plans import slot_runs
from radixserve.cache.page_allocator import PageAllocator

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

SCENARIOS = {
    "ragged_prefills": [(0, 5), (0, 17), (0, 2), (0, 33)],
    "prefix_plus_suffix": [(12, 7), (31, 2), (1, 40), (16, 16)],
    "decodes_only": [(0, 1), (3, 1), (40, 1), (16, 1), (15, 1), (77, 1)],
    "mixed": [(0, 9), (21, 6), (5, 1), (64, 1), (0, 1), (33, 1)],
    # Longer than one query block of the bf16 prefill path (causal_blocks, 128 rows).
    "long_prefills": [(0, 300), (150, 140)],
}


def run(pool, heads, lens, seed, layer=0, **backend_kw):
    hq, hkv = heads
    sc = make_scenario(pool, lens, hq, seed=seed, layer=layer)
    backend = TorchAttentionBackend(num_qo_heads=hq, num_kv_heads=hkv,
                                    head_dim=pool.head_dim, **backend_kw)
    meta = build_metadata(sc.spans, pool.page_size, "cpu")
    out = backend.forward(backend.prepare(meta), layer, sc.q, sc.k, sc.v, pool)
    return sc, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_paged_equals_dense(scenario, heads, page_size, dtype):
    pool = KVPool(1, 600 // page_size + 8, page_size, heads[1], 32, dtype, "cpu")
    sc, out = run(pool, heads, SCENARIOS[scenario], seed=page_size + heads[0])
    assert out.shape == sc.q.shape and out.dtype == dtype
    ref = dense_attention(sc)
    err = (out.double() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"



@pytest.mark.parametrize("sdpa", [False, True], ids=["blocked", "sdpa"])
@pytest.mark.parametrize("scenario", ["ragged_prefills", "prefix_plus_suffix", "long_prefills"])
def test_both_low_precision_prefill_kernels_equal_dense(scenario, sdpa):
    """bf16 prefills run torch's SDPA on AMX machines and the blocked path elsewhere: both
    are checked here whatever this machine has."""
    pool = KVPool(1, 600 // 4 + 8, 4, 2, 32, torch.bfloat16, "cpu")
    sc, out = run(pool, (6, 2), SCENARIOS[scenario], seed=7, sdpa_low_precision=sdpa)
    err = (out.double() - dense_attention(sc)).abs().max().item()
    assert err < TOL[torch.bfloat16], f"max abs error {err}"

@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_new_kv_lands_in_its_slots(page_size):
    pool = KVPool(2, 400 // page_size + 8, page_size, 2, 16, torch.float32, "cpu")
    before = pool.k_flat[1].clone()
    sc, _ = run(pool, (4, 2), SCENARIOS["mixed"], seed=3, layer=1)
    touched = set()
    for s, fk, fv in zip(sc.spans, sc.full_k, sc.full_v):
        for p in range(s.cached_len + s.new_len):          # prefix (helper) + new (forward)
            slot = slot_of(s.pages, p, page_size)
            touched.add(slot)
            assert torch.equal(pool.k_flat[1][slot], fk[p])
            assert torch.equal(pool.v_flat[1][slot], fv[p])
    untouched = torch.tensor(sorted(set(range(pool.num_slots)) - touched))
    assert torch.equal(pool.k_flat[1][untouched], before[untouched])
    assert not pool.k[0].any()                              # layer 0 never written


def test_two_chunks_equal_one_pass():
    """The second chunk of a prompt, reading the first chunk's pages, matches one pass."""
    pool = KVPool(1, 64, 4, 2, 16, torch.float32, "cpu")
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 16, generator=gen) for h in (6, 2, 2))
    pages = np.arange(10, 20, dtype=np.int32)[::-1].copy()

    def step(cached, new):
        meta = build_metadata([SeqSpan(pages, cached, new)], 4, "cpu")
        sl = slice(cached, cached + new)
        return backend.forward(backend.prepare(meta), 0, q[sl], k[sl], v[sl], pool)

    whole = step(0, 40)
    pool.k[0].zero_()
    pool.v[0].zero_()
    first, second = step(0, 23), step(23, 17)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    # and decoding the chunks token by token agrees as well
    tail = torch.cat([step(c, 1) for c in range(30, 40)])
    torch.testing.assert_close(tail, whole[30:], atol=1e-5, rtol=1e-5)


def test_decode_chunking_matches_single_chunk():
    pool = KVPool(1, 800, 1, 2, 16, torch.float32, "cpu")
    lens = [(c, 1) for c in (3, 90, 17, 250, 1, 64, 64, 120)]
    sc, out_one = run(pool, (4, 2), lens, seed=7)
    backend = TorchAttentionBackend(num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                    max_gather_elems=16 * 300)      # forces several chunks
    prepared = backend.prepare(build_metadata(sc.spans, 1, "cpu"))
    assert len(prepared.decodes) > 2
    assert sorted(t for c in prepared.decodes for t in c.tokens.tolist()) == list(range(8))
    out_chunked = backend.forward(prepared, 0, sc.q, sc.k, sc.v, pool)
    torch.testing.assert_close(out_chunked, out_one, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_chunked.double(), dense_attention(sc), atol=2e-5, rtol=0)


def test_custom_sm_scale():
    pool = KVPool(1, 200, 4, 1, 8, torch.float32, "cpu")
    sc, out = run(pool, (2, 1), SCENARIOS["mixed"], seed=1, sm_scale=0.05)
    err = (out.double() - dense_attention(sc, sm_scale=0.05)).abs().max().item()
    assert err < 2e-5


def test_empty_batch_returns_empty():
    pool = KVPool(1, 4, 1, 1, 8, torch.float32, "cpu")
    backend = TorchAttentionBackend(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    meta = build_metadata([], 1, "cpu")
    out = backend.forward(backend.prepare(meta), 0, torch.zeros(0, 2, 8),
                          torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), pool)
    assert out.shape == (0, 2, 8)


def test_unwritten_nan_slots_do_not_leak():
    """Padding for short decodes must never read garbage into the output."""
    pool = KVPool(1, 300, 1, 1, 8, torch.float32, "cpu")
    sc = make_scenario(pool, [(2, 1), (200, 1)], 2, seed=5)
    used = {slot_of(s.pages, p, 1) for s in sc.spans for p in range(s.cached_len + s.new_len)}
    free = torch.tensor(sorted(set(range(300)) - used))
    pool.k_flat[0][free] = float("nan")
    pool.v_flat[0][free] = float("nan")
    backend = TorchAttentionBackend(num_qo_heads=2, num_kv_heads=1, head_dim=8)
    out = backend.forward(backend.prepare(build_metadata(sc.spans, 1, "cpu")), 0,
                          sc.q, sc.k, sc.v, pool)
    assert torch.isfinite(out).all()
    assert (out.double() - dense_attention(sc)).abs().max() < 2e-5


def test_strided_inputs_from_a_fused_qkv_projection():
    """The model splits one qkv matmul, so q/k/v arrive as strided views."""
    pool = KVPool(1, 300, 4, 2, 16, torch.float32, "cpu")
    sc = make_scenario(pool, SCENARIOS["mixed"], 6, seed=11)
    t = sc.q.shape[0]
    fused = torch.cat([sc.q.reshape(t, -1), sc.k.reshape(t, -1), sc.v.reshape(t, -1)], dim=1)
    q, k, v = fused.split([6 * 16, 2 * 16, 2 * 16], dim=-1)
    q, k, v = q.view(t, 6, 16), k.view(t, 2, 16), v.reshape(t, 2, 16)
    assert not q.is_contiguous() and not v.is_contiguous()
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=16)
    out = backend.forward(backend.prepare(build_metadata(sc.spans, 4, "cpu")), 0, q, k, v, pool)
    assert (out.double() - dense_attention(sc)).abs().max() < 2e-5


def test_slot_runs():
    assert slot_runs(np.array([4, 5, 6, 9, 10, 2])) == [(4, 3), (9, 2), (2, 1)]
    assert slot_runs(np.arange(7, 12)) == [(7, 5)]
    assert slot_runs(np.array([1, 3, 5, 7, 9]), max_runs=4) is None


def pages_in_runs(npages: int, runs: int) -> np.ndarray:
    """`npages` page ids in `runs` pieces of consecutive ids, gaps between them, the pieces
    in reverse order (so no two pieces join)."""
    pieces, base = [], 1
    for cut in np.array_split(np.arange(npages), runs):
        pieces.append(base + np.arange(len(cut)))
        base += 2 * len(cut) + 2
    return np.concatenate(pieces[::-1]).astype(np.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("runs", [1, 2, 4])
def test_lone_decode_read_in_place_equals_gathered_and_dense(runs, page_size, dtype):
    """A single decode whose pages form `runs` runs of consecutive ids attends over the
    pool in place: the same result as the gather path and dense attention."""
    pool = KVPool(1, 800 // page_size + 8, page_size, 2, 32, dtype, "cpu")
    sc = make_scenario(pool, [(150, 1)], 6, seed=runs + page_size)
    check_lone_decode_in_place(pool, sc, pages_in_runs(len(sc.spans[0].pages), runs), runs,
                               dtype)


def check_lone_decode_in_place(pool: KVPool, sc, pages: np.ndarray, runs: int,
                               dtype: torch.dtype) -> None:
    """Move the scenario's lone decode (150 cached tokens) onto ``pages``, then check its
    plan reads ``runs`` runs in place, equal to the gather path and to dense attention."""
    for p in range(150):                     # the cached prefix, written at the new slots
        slot = slot_of(pages, p, pool.page_size)
        pool.k_flat[0][slot], pool.v_flat[0][slot] = sc.full_k[0][p], sc.full_v[0][p]
    sc.spans[0] = SeqSpan(pages, 150, 1)
    backend = TorchAttentionBackend(num_qo_heads=6, num_kv_heads=2, head_dim=32)
    plan = backend.prepare(build_metadata(sc.spans, pool.page_size, "cpu"))
    assert plan.decodes[0].runs is not None and len(plan.decodes[0].runs) == runs
    assert plan.lone is plan.decodes[0]                    # the whole step: the short path
    in_place = backend.forward(plan, 0, sc.q, sc.k, sc.v, pool)
    plan.lone = None                                       # the general step, same reads
    assert torch.equal(backend.forward(plan, 0, sc.q, sc.k, sc.v, pool), in_place)
    plan.decodes[0].runs = None                                    # the gather path
    gathered = backend.forward(plan, 0, sc.q, sc.k, sc.v, pool)
    torch.testing.assert_close(in_place, gathered, atol=TOL[dtype] / 4, rtol=0)
    err = (in_place.double() - dense_attention(sc)).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lone_decode_on_allocator_pages_reads_in_place(dtype):
    """A served stream's pages as the allocator hands them out: the prompt's in one call
    (descending ids), then one per decoded token (ascending). In position order every
    token is its own run; the plan reads them in slot order: one run, in place."""
    pool = KVPool(1, 300, 1, 2, 32, dtype, "cpu")
    sc = make_scenario(pool, [(150, 1)], 6, seed=11)
    allocator = PageAllocator(pool.num_pages)
    prompt = allocator.alloc(140)
    decoded = np.concatenate([allocator.alloc(1) for _ in range(11)])
    pages = np.concatenate([prompt, decoded]).astype(np.int32)
    assert (np.diff(prompt) == -1).all() and (np.diff(decoded) == 1).all()
    check_lone_decode_in_place(pool, sc, pages, 1, dtype)
