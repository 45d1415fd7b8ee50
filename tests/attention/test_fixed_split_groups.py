"""Deterministic mode's decode groups: decodes sharing whole split-chunks of cached pages
compute those chunks once for the group, and every output is bit-identical to computing each
decode on its own (FixedSplitBackend(group_decodes=False))."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.attention.fixed_split import FixedSplitBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import SeqSpan, build_metadata

HQ, HKV, D = 9, 3, 64


def build_step(groups: list[tuple[int, list[int]]], loners: list[int], page_size: int,
               dtype: torch.dtype, seed: int):
    """A step of decodes (after one prefill): per group (prefix_len, tail lengths), members
    whose first prefix_len // page_size pages are the same pool pages (the partial page and
    the tail are each member's own copy), plus decodes of unrelated sequences ``loners``.
    A tail length counts the decoded token. Returns (pool, spans, q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    rand = lambda n, h: torch.randn(n, h, D, generator=gen).to(dtype)   # noqa: E731
    seqs = [(rand(150, HKV), rand(150, HKV), 0, 150)]                    # (k, v, shared, new)
    shared_pages = []
    for prefix, tails in groups:
        pk, pv = rand(prefix, HKV), rand(prefix, HKV)
        shared_pages.append(prefix // page_size)
        for tail in tails:
            seqs.append((torch.cat([pk, rand(tail, HKV)]), torch.cat([pv, rand(tail, HKV)]),
                         len(shared_pages), 1))
    seqs += [(rand(n, HKV), rand(n, HKV), 0, 1) for n in loners]
    need = sum(shared_pages) + sum(-(-len(k) // page_size) for k, *_ in seqs)
    pool = KVPool(1, need, page_size, HKV, D, dtype, "cpu")
    free = iter(rng.permutation(need).astype(np.int32))
    common = [np.array([next(free) for _ in range(n)], dtype=np.int32) for n in shared_pages]
    spans, ks, vs = [], [], []
    for k, v, group, new in seqs:
        own = common[group - 1] if group else np.zeros(0, dtype=np.int32)
        pages = np.concatenate([own, [next(free) for _ in range(-(-len(k) // page_size)
                                                                 - len(own))]])
        pages = pages.astype(np.int32)
        for p in range(len(k) - new):
            s = int(pages[p // page_size]) * page_size + p % page_size
            pool.k_flat[0][s], pool.v_flat[0][s] = k[p], v[p]
        spans.append(SeqSpan(pages=pages, cached_len=len(k) - new, new_len=new))
        ks.append(k[len(k) - new:])
        vs.append(v[len(v) - new:])
    q = rand(sum(s.new_len for s in spans), HQ)
    return pool, spans, q, torch.cat(ks), torch.cat(vs)


def attend(spans, pool, q, k, v, page_size, grouped: bool, split: int, gather_elems: int):
    backend = FixedSplitBackend(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, split=split,
                                group_decodes=grouped, max_gather_elems=gather_elems)
    plan = backend.prepare(build_metadata(spans, page_size, "cpu"))
    return backend.forward(plan, 0, q, k, v, pool), plan


def shared_spans(plan) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Each group's members -> the (first, chunks) slices computed for it, from a plan whose
    calls may batch several groups."""
    shared: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for s in plan.shared:
        assert s.groups == len(s.sizes) and s.real.shape == s.decodes.shape
        assert s.tokens.shape[0] == s.groups * s.members
        ends = np.cumsum(s.sizes)
        for members in np.split(s.decodes.numpy(), ends[:-1]):
            shared.setdefault(tuple(members.tolist()), []).append((s.first, s.chunks))
    return shared


def split_groups(split: int) -> list[tuple[int, list[int]]]:
    # Prefix lengths off the split (the partial chunk is each member's own), one exactly on
    # it with a member decoding right after it; groups of 2, 5 and 17.
    return [(200 + split, [1, 40]), (2 * split, [1, 3, 70, 200, 9]),
            (3 * split + 37, [int(n) for n in np.arange(1, 18) * 13])]


def batched_groups(split: int) -> list[tuple[int, list[int]]]:
    # Three groups of 2, 5 and 3 members with the same number of whole shared chunks (2),
    # computed in one call batched over the groups (members padded to 5).
    return [(2 * split + 5, [1, 40]), (2 * split + 30, [1, 3, 70, 200, 9]),
            (2 * split, [7, 1, 11])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("split,gather_elems", [(64, 2**20), (64, HKV * 64 * D), (256, 2**20)])
@pytest.mark.parametrize("layout", [split_groups, batched_groups])
def test_grouped_decodes_bit_identical_to_ungrouped(dtype, page_size, split, gather_elems,
                                                    layout):
    groups = layout(split)                          # plus unrelated decodes
    pool, spans, q, k, v = build_step(groups, [90, 600, 1], page_size, dtype,
                                      seed=page_size + split)
    got, plan = attend(spans, pool, q, k, v, page_size, True, split, gather_elems)
    want, plain = attend(spans, pool, q, k, v, page_size, False, split, gather_elems)
    # Groups formed, over whole chunks only: the plan really took the grouped path.
    shared = shared_spans(plan)
    if layout is batched_groups and gather_elems == 2**20:
        assert [s.groups for s in plan.shared] == [3]                # one batched call
    expect = [(len(t), (p - p % page_size) // split) for p, t in groups]
    assert sorted((len(m), sum(c for _, c in spans_)) for m, spans_ in shared.items()) \
        == sorted(expect)
    assert all(first == sum(c for _, c in spans_[:i]) for spans_ in shared.values()
               for i, (first, _) in enumerate(spans_))
    if gather_elems < 2**20:
        assert any(len(spans_) > 1 for spans_ in shared.values())     # sliced gathers
    assert not plain.shared
    assert torch.equal(got, want)
    # And a member alone in its step gives the same bits.
    member = 1 + len(groups[0][1])                  # first member of the second group
    tok = slice(150 + member - 1, 150 + member)     # after the 150-token prefill
    alone, _ = attend([spans[member]], pool, q[tok], k[tok], v[tok], page_size, True, split,
                      gather_elems)
    assert torch.equal(alone, got[tok])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_results_of_a_big_group_match_each_member_alone(dtype):
    """The grouped shapes themselves: 64 members' query rows (192 rows) against shared
    256-key chunks in one matmul give each member's rows what the member gets alone."""
    from radixserve.attention.fixed_split import chunk_partials
    gen = torch.Generator().manual_seed(5)
    m, g, split, chunks = 64, HQ // HKV, 256, 4
    q = torch.randn(m, HKV, g, D, generator=gen).to(dtype)
    k, v = (torch.randn(1, HKV, chunks * split, D, generator=gen).to(dtype) for _ in "kv")
    o, lse = chunk_partials(q.transpose(0, 1).reshape(1, HKV, m * g, D), k, v, None, chunks,
                            split, D ** -0.5)
    o = o.view(HKV, chunks, m, g, D).permute(2, 0, 1, 3, 4)
    lse = lse.view(HKV, chunks, m, g).permute(2, 0, 1, 3)
    for i in (0, 17, 63):
        o1, lse1 = chunk_partials(q[i:i + 1], k, v, None, chunks, split, D ** -0.5)
        assert torch.equal(o1[0], o[i]) and torch.equal(lse1[0], lse[i])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_results_of_a_group_match_inside_a_batch_of_groups(dtype):
    """The batched shared-chunk shapes: a group's rows against its chunks give the same bits
    alone as inside a call batched over 2, 3 or 5 groups (each group its own keys)."""
    from radixserve.attention.fixed_split import chunk_partials
    gen = torch.Generator().manual_seed(7)
    rows, split, chunks = 8 * (HQ // HKV), 256, 4
    q = torch.randn(5, HKV, rows, D, generator=gen).to(dtype)
    k, v = (torch.randn(5, HKV, chunks * split, D, generator=gen).to(dtype) for _ in "kv")
    alone = [chunk_partials(q[i:i + 1], k[i:i + 1], v[i:i + 1], None, chunks, split,
                            D ** -0.5) for i in range(5)]
    for groups in (2, 3, 5):
        o, lse = chunk_partials(q[:groups], k[:groups], v[:groups], None, chunks, split,
                                D ** -0.5)
        for i in range(groups):
            assert torch.equal(o[i], alone[i][0][0]) and torch.equal(lse[i], alone[i][1][0])
