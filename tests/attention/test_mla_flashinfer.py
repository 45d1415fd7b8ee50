"""The flashinfer MLA backend's calls, bound to the installed
``flashinfer.mla.BatchMLAPagedAttentionWrapper``'s signatures, with a fake kernel that
computes what flashinfer documents (absorbed attention over ckv/kpe pages, causal
bottom-right): equal to the torch MLA backend on the same pool."""

from __future__ import annotations

import flashinfer.mla
import numpy as np
import torch

from flashinfer_fakes import bind_real
from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.attention.mla_flashinfer import FlashInferMLABackend, mla_plan_args
from radixserve.attention.mla_torch import MLATorchBackend
from radixserve.attention.mla_weights import LatentProjections

REAL = flashinfer.mla.BatchMLAPagedAttentionWrapper
H, NOPE, V, R, ROPE, PAGE = 4, 16, 12, 32, 8, 4
# (cached, new): prefills fresh and over a cached prefix, then decodes
LENS = [(0, 9), (10, 5), (13, 1), (4, 1), (0, 1)]


class FakeMLA:
    def __init__(self, *args, **kwargs):
        self.init = bind_real(REAL.__init__, self, *args, **kwargs)
        self.plans: list[dict] = []

    def plan(self, *args, **kwargs):
        self.plans.append(bind_real(REAL.plan, self, *args, **kwargs))

    def run(self, *args, **kwargs):
        a, p = bind_real(REAL.run, self, *args, **kwargs), self.plans[-1]
        q, q_pe, ckv, kpe = a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"]
        assert q.shape[-1] == p["head_dim_ckv"] and q_pe.shape[-1] == p["head_dim_kpe"]
        out = torch.empty_like(q)
        qo, kv_ptr = p["qo_indptr"].tolist(), p["kv_indptr"].tolist()
        for b, kv_len in enumerate(p["kv_len_arr"].tolist()):
            pages = p["kv_indices"][kv_ptr[b]:kv_ptr[b + 1]].long()
            c = ckv[pages].reshape(-1, ckv.shape[-1])[:kv_len]
            k = kpe[pages].reshape(-1, kpe.shape[-1])[:kv_len]
            lo, hi = qo[b], qo[b + 1]
            s = (torch.einsum("nhr,kr->hnk", q[lo:hi], c)
                 + torch.einsum("nhr,kr->hnk", q_pe[lo:hi], k)) * p["sm_scale"]
            n = hi - lo
            if p["causal"]:
                allowed = torch.arange(kv_len)[None, :] <= kv_len - n + torch.arange(n)[:, None]
                s = s.masked_fill(~allowed, float("-inf"))
            out[lo:hi] = torch.einsum("hnk,kr->nhr", s.softmax(-1), c)
        return out


def _step(backend):
    g = torch.Generator().manual_seed(0)
    proj = LatentProjections(H, NOPE, V, R, (NOPE + ROPE) ** -0.5)
    proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * 0.3)
    pool = LatentKVPool(1, 32, PAGE, R, ROPE, torch.float32, "cpu")
    pages = np.random.default_rng(0).permutation(32).astype(np.int32)
    spans, start, cached_rows = [], 0, []
    for cached, new in LENS:
        n = -(-(cached + new) // PAGE)
        spans.append(SeqSpan(pages[start:start + n], 0, cached))
        start += n
    # the cached prefixes first (one step), then the step under test
    warm = [s for s in spans if s.new_len]
    meta = build_metadata(warm, PAGE, "cpu")
    t = meta.num_tokens
    MLATorchBackend(num_heads=H).forward_latent(
        MLATorchBackend(num_heads=H).prepare(meta), 0, torch.randn(t, H, NOPE, generator=g),
        torch.randn(t, H, ROPE, generator=g), torch.randn(t, R, generator=g),
        torch.randn(t, ROPE, generator=g), proj, pool)
    spans = [SeqSpan(s.pages, c, n) for s, (c, n) in zip(spans, LENS)]
    meta = build_metadata(spans, PAGE, "cpu")
    t = meta.num_tokens
    args = [torch.randn(t, H, NOPE, generator=g), torch.randn(t, H, ROPE, generator=g),
            torch.randn(t, R, generator=g), torch.randn(t, ROPE, generator=g)]
    return backend.forward_latent(backend.prepare(meta), 0, *args, proj, pool), meta


def test_calls_bind_and_the_fake_kernel_matches_the_torch_backend():
    fi = FlashInferMLABackend(num_heads=H, kv_lora_rank=R, rope_dim=ROPE,
                              sm_scale=(NOPE + ROPE) ** -0.5, dtype=torch.float32,
                              device="cpu", wrapper_cls=FakeMLA)
    got, meta = _step(fi)
    expected, _ = _step(MLATorchBackend(num_heads=H))
    assert (got - expected).abs().max().item() < 1e-5
    plan = fi.wrapper.plans[-1]
    assert plan["kv_len_arr"].tolist() == [c + n for c, n in LENS]
    assert plan["qo_indptr"].tolist() == list(np.cumsum([0] + [n for _, n in LENS]))
    assert plan["kv_indptr"].dtype == torch.int32 and plan["causal"] is True
    assert (plan["head_dim_ckv"], plan["head_dim_kpe"], plan["page_size"]) == (R, ROPE, PAGE)


def test_plan_args_bind_to_the_real_signature():
    meta = build_metadata([SeqSpan(np.arange(3, dtype=np.int32), 5, 4)], PAGE, "cpu")
    args = mla_plan_args(meta, num_heads=H, kv_lora_rank=R, rope_dim=ROPE, sm_scale=0.1,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    bound = bind_real(REAL.plan, object(), **args)
    assert bound["kv_indices"].tolist() == [0, 1, 2] and bound["kv_len_arr"].tolist() == [9]
