"""The lone decode (one sequence, one new token) of a Llama-family model as one pure function,
for ahead-of-time compilation (``compiled_decode.py``).

Why a second form of the step: in eager torch a batch-1 token pays per-op dispatch over
~130 small ops per layer, more than the weights' own kernels (docs/benchmarks.md, "the
ideal step"). Compiled whole by Inductor those ops fuse; only a function whose inputs are
plain tensors can be compiled ahead and loaded again from disk, so this module reads the
model's weights (the same modules, the same kernels: int4/int8 linears stay
``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``) and takes the KV pool as
arguments. It writes the new token's K and V into the pool itself (``index_copy_`` at
``new_slot``, every layer): compiled, that is an in-place store inside the library, where
writing them back from Python cost 60 dispatched copies a token.

Attention reads the pool through ``cached_slots`` (the sequence's earlier tokens' slots,
any order: one unmasked query attends to a set of keys) and appends the new token's own
K/V. It computes in float32 whatever the activations' dtype: the gather upcasts K/V as it
copies them, and scores and output are Inductor's own fused reductions. With bf16
activations the two ``bmm`` calls in bf16 took 31% of a compiled token at context 512
(py-spy, docs/benchmarks.md); in float32 the same attention took 2.0-2.5 ms instead of
4.1-4.6 ms for 30 layers at 512 tokens, and it is closer to a float32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.kv_pool import KVPool

from .llama import LlamaForCausalLM
from .rope import apply_rotary


def unsupported_reason(model: nn.Module, kv_pool: KVPool) -> str | None:
    """Why the lone step cannot stand in for ``model``'s eager decode, or None if it can."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the plain Llama family"
    cfg = model.config
    if cfg.layer_windows is not None and any(w is not None for w in cfg.layer_windows):
        return "sliding-window layers"
    if cfg.attn_logit_softcapping is not None:
        return "attention logit soft-capping"
    if kv_pool.quantized:
        return "an 8-bit KV cache"
    if model.device.type != "cpu":
        return "not a CPU model"
    return None


class LoneDecodeStep(nn.Module):
    """(token [1], position [1], cached_slots [n], new_slot [1], per-layer pool K and V
    [slots, Hkv, D]) -> float32 logits [1, vocab]; the new K/V stored at ``new_slot``."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model
        cfg = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.scale = cfg.attention_scale or self.head_dim ** -0.5

    def forward(self, token: torch.Tensor, position: torch.Tensor, cached_slots: torch.Tensor,
                new_slot: torch.Tensor, k_pools: list[torch.Tensor],
                v_pools: list[torch.Tensor]) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(token)
        cos, sin = m.rotary.cos[position].unsqueeze(1), m.rotary.sin[position].unsqueeze(1)
        for layer, k_pool, v_pool in zip(m.layers, k_pools, v_pools):
            o, k, v = self._attention(layer, layer.input_layernorm(h), cos, sin,
                                      cached_slots, k_pool, v_pool)
            k_pool.index_copy_(0, new_slot, k.to(k_pool.dtype))
            v_pool.index_copy_(0, new_slot, v.to(v_pool.dtype))
            h = h + layer.o_proj(o)
            h = h + layer.mlp_block(layer.post_attention_layernorm(h))
        return m.lm_head(m.norm(h)).float()

    def _attention(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cached_slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (attention output [1, Hq * D] before o_proj, new k and v [1, Hkv, D])."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv_proj(x)
        q_end, k_end = layer.split[0], layer.split[0] + layer.split[1]
        q, k = qkv[:, :q_end].view(1, hq, d), qkv[:, q_end:k_end].view(1, hkv, d)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = qkv[:, k_end:].view(1, hkv, d)
        f32 = torch.float32
        keys = torch.cat([k_pool.index_select(0, cached_slots).to(f32), k.to(f32)])
        values = torch.cat([v_pool.index_select(0, cached_slots).to(f32), v.to(f32)])
        qd = q.view(hkv, hq // hkv, 1, d).to(f32)   # the GQA group folded into the rows
        scores = (qd * keys.permute(1, 0, 2).unsqueeze(1)).sum(-1) * self.scale  # [Hkv, g, n+1]
        probs = F.softmax(scores, dim=-1)
        o = (probs.unsqueeze(-1) * values.permute(1, 0, 2).unsqueeze(1)).sum(2)  # [Hkv, g, D]
        return o.reshape(1, hq * d).to(q.dtype), k, v


def pool_views(kv_pool: KVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V as [slots, Hkv, D] (the pool's own token-granular views)."""
    return list(kv_pool.k_flat), list(kv_pool.v_flat)


def scratch_pools(kv_pool: KVPool, slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V of ``slots`` tokens in the pool's dtype, filled with a fixed random
    draw: pools for checking the step apart from the live one."""
    g = torch.Generator().manual_seed(0)
    k_flat = kv_pool.k_flat[kv_pool.layers[0]]
    shape, dtype = (slots, *k_flat.shape[1:]), k_flat.dtype
    make = [torch.randn(shape, generator=g).to(dtype) for _ in range(2 * len(kv_pool.layers))]
    return make[0::2], make[1::2]
