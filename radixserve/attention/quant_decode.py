"""Decode attention over 8-bit KV with the scales folded into the softmax's inputs.

Decoding every gathered element (code * its row's scale) made a decode step at batch 32
take 1.3-1.55x the time with 8-bit KV as with bf16 KV. Here the gather only turns codes
into floats (kv_quant.gather_folded); a key's scale multiplies its score and a value's its
probability, one multiply per token and query head instead of one per element:

    q . (s_k * k)            = s_k * (q . k)
    sum_j p_j * (s_j * v_j)  = sum_j (p_j * s_j) * v_j

Same attention, rounded in a different order: within fp32 rounding of attention over the
decoded K/V (tests/attention/test_kv_quant.py).
"""

from __future__ import annotations

import torch

from radixserve.attention.kv_quant import FoldedRows
from radixserve.attention.partial_attention import softmax_with_lse


def folded_decode_attention(q: torch.Tensor, k: FoldedRows, v: FoldedRows, sm_scale: float,
                            mask: torch.Tensor | None, with_lse: bool
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [b, Hkv, group, D] (one decode token per sequence, GQA group folded in); k/v rows
    head-major [b * Hkv * max_kv, D]; mask additive fp32 [b, 1, 1, max_kv] or None.

    Returns o [b, Hkv, group, D] in q's dtype and, if ``with_lse``, the fp32 log-sum-exp
    [b, Hkv, group]. Matmuls in q's dtype, softmax in fp32, as the unquantized decode."""
    b, hkv, _, d = q.shape
    dt = q.dtype
    kd = k.values.view(b, hkv, -1, d).to(dt)
    vd = v.values.view(b, hkv, -1, d).to(dt)
    per_key = (b, hkv, 1, kd.shape[2])
    if k.lift != 1.0:
        q = q * k.lift                            # exact: a power of two
    scores = torch.matmul(q, kd.transpose(-1, -2)).float()
    scores.mul_(sm_scale if k.scales is None else k.scales.mul_(sm_scale).view(per_key))
    if mask is not None:
        scores.add_(mask)
    probs, lse = softmax_with_lse(scores) if with_lse else (scores.softmax(-1), None)
    if v.scales is not None:
        probs.mul_(v.scales.view(per_key))
    o = torch.matmul(probs.to(dt), vd)
    if v.lift != 1.0:
        o.mul_(v.lift)
    return o, lse
