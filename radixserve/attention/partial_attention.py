"""Attention over one part of a context, with its log-sum-exp, and the merge of two parts.

Softmax attention over keys split into two disjoint sets A and B decomposes exactly: with
``o_X`` the attention over X alone and ``lse_X = log(sum(exp(scores over X)))``,

    lse = logaddexp(lse_A, lse_B)
    o   = o_A * exp(lse_A - lse) + o_B * exp(lse_B - lse)

Cascade attention uses it to attend to a prefix shared by many sequences once, as one large
matmul, and to each sequence's own remainder separately.
"""

from __future__ import annotations

import math

import torch

from radixserve.attention.workspace import Workspace

# Scores of one row chunk, across heads, in elements (4 MiB in fp32). Smaller chunks stay in
# L2 but pay ~10 kernel launches each; measured at 2,048 queries x 9 heads over 1,024 keys
# (bf16, 1 and 2 threads) 2**20 beat 2**16..2**19 and 2**21..2**22.
DEFAULT_MAX_SCORE_ELEMS = 2**20


def softmax_with_lse(scores: torch.Tensor,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over the last dim (into ``out`` if given) and its log-sum-exp; every row
    needs a finite score.

    Uses the fused softmax kernel and recovers the normaliser from it: the row's largest
    probability is exp(max - lse), so lse = max - log(max probability). Two cheap reductions
    instead of a second pass of exp (logsumexp costs as much again as the softmax on CPU).
    """
    row_max = scores.amax(-1)
    probs = torch.softmax(scores, -1) if out is None else torch.softmax(scores, -1, out=out)
    return probs, row_max - probs.amax(-1).log()


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, workspace: Workspace | None = None,
                    max_score_elems: int = DEFAULT_MAX_SCORE_ELEMS,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., R, D], k/v [..., S, D] (same leading dims), mask: additive fp32 (0 / -inf)
    broadcastable to [..., R, S], or None; every row must see at least one key.

    Returns o [..., R, D] in q's dtype and lse [..., R] in fp32 (written into ``out``/``lse``
    when given). Scores are computed in q's dtype (bf16 matmuls are the fast path on CPU) with
    the scale fused into the matmul, then masked and softmaxed in fp32: the numerics of
    transformers' eager attention. Rows are processed in chunks of at most
    ``max_score_elems`` scores whose temporaries come from ``workspace``.
    """
    ws = workspace if workspace is not None else Workspace()
    *lead, rows, dim = q.shape
    keys, dt, dev = k.shape[-2], q.dtype, q.device
    if out is None:
        out = torch.empty(*lead, rows, v.shape[-1], dtype=dt, device=dev)
    if lse is None:
        lse = torch.empty(*lead, rows, dtype=torch.float32, device=dev)
    batch = math.prod(lead)
    kt = k.reshape(batch, keys, dim).transpose(1, 2)
    v3 = v.reshape(batch, keys, v.shape[-1])
    zero = q.new_zeros(())
    step = max(1, max_score_elems // max(1, batch * keys))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        shape = (*lead, r1 - r0, keys)
        scores = ws.take("attn.scores", shape, dt, dev)
        torch.baddbmm(zero, q[..., r0:r1, :].reshape(batch, r1 - r0, dim), kt, beta=0.0,
                      alpha=scale, out=scores.view(batch, r1 - r0, keys))
        if dt != torch.float32:
            scores32 = ws.take("attn.scores32", shape, torch.float32, dev)
            if mask is None:
                scores = scores32.copy_(scores)
            else:
                scores = torch.add(_rows(mask, r0, r1), scores, out=scores32)
        elif mask is not None:
            scores.add_(_rows(mask, r0, r1))
        probs, lse[..., r0:r1] = softmax_with_lse(
            scores, out=ws.take("attn.probs", shape, torch.float32, dev))
        if dt != torch.float32:
            probs = ws.take("attn.probs_lp", shape, dt, dev).copy_(probs)
        o = out if r1 - r0 == rows else ws.take("attn.out", shape[:-1] + out.shape[-1:],
                                                 dt, dev)
        torch.bmm(probs.view(batch, r1 - r0, keys), v3, out=o.view(batch, r1 - r0, -1))
        if o is not out:
            out[..., r0:r1, :] = o
    return out, lse


def flash_attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          mask: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_with_lse for 4-D q [B, H, R, D], k/v [B, H, S, D] through torch's fused CPU
    flash-attention kernel, which returns the log-sum-exp itself: one pass over K/V with
    an online softmax, no score tensors. On AMX its GEMMs run at the bf16 rate (about twice
    attend_with_lse's speed at decode shapes); probabilities are rounded to q's dtype before
    the product with V, as attend_with_lse rounds them."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return o, lse


def _rows(mask: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a mask, which may broadcast over rows (size 1 there)."""
    return mask if mask.shape[-2] == 1 else mask[..., r0:r1, :]


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor, out: torch.Tensor | None = None,
                           ) -> torch.Tensor:
    """Combine attention over two disjoint key sets: o [N, H, D], lse [N, H] -> fp32
    [N, H, D] (into ``out`` when given)."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = (lse_a - lse).exp_().unsqueeze(-1)
    w_b = (lse_b - lse).exp_().unsqueeze(-1)
    if out is None:
        out = torch.empty(o_a.shape, dtype=torch.float32, device=o_a.device)
    torch.mul(o_a, w_a, out=out)
    return out.addcmul_(o_b, w_b)
