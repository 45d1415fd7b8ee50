"""Fake flashinfer wrappers bound to the installed flashinfer's real signatures.

Every ``__init__`` / ``plan`` / ``run`` call is first bound to the real method's signature
(``inspect.signature(...).bind``), and the arguments are then read by the *real* parameter
names: a renamed keyword, a misplaced positional or a removed argument fails here, on CPU.
``run`` then computes what flashinfer documents for paged attention: K/V gathered page by page
from ``indptr`` / ``indices`` / ``last_page_len`` (NHD layout), a causal mask aligned
bottom-right, and the softmax taken in base 2 (scores times log2(e); ``lse`` in log2 units);
``window_left`` keeps keys within that many positions before the query, ``logits_soft_cap``
maps the scaled logits x to cap * tanh(x / cap).
"""

from __future__ import annotations

import importlib.machinery
import inspect
import math
import types

import torch

LOG2_E = 1.0 / math.log(2.0)


def bind_real(real_method, *args, **kwargs) -> dict:
    """The call's arguments by the real method's parameter names (defaults filled in);
    raises TypeError exactly where the real method would refuse the call."""
    sig = inspect.signature(real_method)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    for name, p in sig.parameters.items():        # **kwargs of the real method: merge in
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(out.pop(name, {}))
    return out


def paged_attention_base2(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len,
                          sm_scale: float, causal: bool, k_scale: float = 1.0,
                          v_scale: float = 1.0, window_left: int = -1,
                          logits_soft_cap: float | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D] in q's dtype, lse [T, Hq] float32 in base 2), per flashinfer's docs."""
    page_size, hkv, d = k_cache.shape[1:]
    hq = q.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    for b in range(len(kv_indptr) - 1):
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long().cpu()
        kv_len = (len(pages) - 1) * page_size + int(last_page_len[b])
        k = k_cache.cpu()[pages].reshape(-1, hkv, d)[:kv_len].float() * k_scale
        v = v_cache.cpu()[pages].reshape(-1, hkv, d)[:kv_len].float() * v_scale
        k = k.repeat_interleave(hq // hkv, 1)                 # [kv_len, Hq, D]
        v = v.repeat_interleave(hq // hkv, 1)
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        qs = q[lo:hi].float().cpu()
        s2 = torch.einsum("nhd,khd->hnk", qs, k) * sm_scale
        if logits_soft_cap:
            s2 = torch.tanh(s2 / logits_soft_cap) * logits_soft_cap
        s2 = s2 * LOG2_E
        n = hi - lo
        q_pos = kv_len - n + torch.arange(n)[:, None]      # bottom-right aligned
        keys = torch.arange(kv_len)[None, :]
        allowed = keys <= q_pos if causal else torch.ones(n, kv_len, dtype=torch.bool)
        if window_left >= 0:
            allowed = allowed & (keys >= q_pos - window_left)
        s2 = s2.masked_fill(~allowed, float("-inf"))
        m = s2.amax(-1, keepdim=True)
        p = torch.exp2(s2 - m)
        denom = p.sum(-1, keepdim=True)
        out[lo:hi] = torch.einsum("hnk,khd->nhd", p / denom, v).to(q.dtype).to(q.device)
        lse[lo:hi] = (m + torch.log2(denom)).squeeze(-1).transpose(0, 1)
    return out, lse


class _FakeWrapper:
    real: type
    head_dim_name: str        # what the real plan() calls the head dim
    causal: bool | None       # None: read plan(causal=...)

    def __init__(self, *args, **kwargs):
        self.init = bind_real(self.real.__init__, self, *args, **kwargs)
        self.plans: list[dict] = []

    def plan(self, *args, **kwargs):
        self.plans.append(self._bind_plan(*args, **kwargs))

    def _bind_plan(self, *args, **kwargs) -> dict:
        return bind_real(self.real.plan, self, *args, **kwargs)

    def run(self, q, paged_kv_cache, *args, **kwargs):
        a = bind_real(self.real.run, self, q, paged_kv_cache, *args, **kwargs)
        assert not a["args"], "positional run() arguments past paged_kv_cache"
        k_cache, v_cache = a["paged_kv_cache"]
        p = self.plans[-1]
        head_dim = p[self.head_dim_name]
        assert self.init["kv_layout"] == "NHD" and k_cache.shape[1:] == (
            p["page_size"], p["num_kv_heads"], head_dim)
        out, lse = paged_attention_base2(
            q, k_cache, v_cache, *self._csr(q),
            sm_scale=head_dim ** -0.5 if p["sm_scale"] is None else p["sm_scale"],
            causal=p["causal"] if self.causal is None else self.causal,
            k_scale=a["k_scale"] or 1.0, v_scale=a["v_scale"] or 1.0,
            window_left=p.get("window_left", -1), logits_soft_cap=p.get("logits_soft_cap"))
        return (out, lse) if a["return_lse"] else out


class FakePrefill(_FakeWrapper):
    head_dim_name, causal = "head_dim_qk", None

    def _csr(self, q):
        p = self.plans[-1]
        assert int(p["qo_indptr"][-1]) == q.shape[0] and q.shape[1] == p["num_qo_heads"]
        return (p["qo_indptr"], p["paged_kv_indptr"], p["paged_kv_indices"],
                p["paged_kv_last_page_len"])


class FakeDecode(_FakeWrapper):
    head_dim_name, causal = "head_dim", False

    def _bind_plan(self, *args, **kwargs) -> dict:
        a = bind_real(self.real.plan, self, *args, **kwargs)
        assert not a.get("deprecated_positional_args"), "optional plan() args by position"
        a.pop("deprecated_positional_args", None)
        if not hasattr(self.real, "_plan_impl"):     # flashinfer < 0.6: keywords in plan()
            return a
        # 0.6+: plan(**kwargs) forwards to _plan_impl: bind there for the keyword names.
        return bind_real(self.real._plan_impl, self, **{k: v for k, v in a.items()
                                                         if k != "self"})

    def _csr(self, q):
        p = self.plans[-1]
        b = len(p["indptr"]) - 1
        assert q.shape[0] == b, "decode: one query per sequence"
        return torch.arange(b + 1), p["indptr"], p["indices"], p["last_page_len"]


def fake_flashinfer(real=None, plan_error: BaseException | None = None) -> types.ModuleType:
    """A module standing in for ``flashinfer``: wrappers bound to ``real``'s signatures (the
    installed flashinfer by default); ``plan_error``: raised by every plan() instead."""
    if real is None:
        import flashinfer as real
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.__version__ = f"fake of {getattr(real, '__version__', '?')}"
    for name, base in (("BatchPrefillWithPagedKVCacheWrapper", FakePrefill),
                       ("BatchDecodeWithPagedKVCacheWrapper", FakeDecode)):
        attrs = {"real": getattr(real, name)}
        if plan_error is not None:
            def plan(self, *args, _exc=plan_error, **kwargs):
                self._bind_plan(*args, **kwargs)
                raise _exc
            attrs["plan"] = plan
        setattr(module, name, type(name, (base,), attrs))
    return module
