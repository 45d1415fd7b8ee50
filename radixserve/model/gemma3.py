"""Gemma 3 (text) and Gemma 2 over paged KV: the Llama blocks with Gemma's differences.

Per layer: (1 + w) RMSNorms before *and after* both attention and the MLP, q/k norms,
GeGLU (gelu tanh) instead of SwiGLU, and RoPE whose base depends on the layer type
(sliding-window layers: `rope_local_theta`). Per model: embeddings scaled by
sqrt(hidden_size) and optional final-logit soft-capping. The attention scale
(query_pre_attn_scalar), the attention logit soft-cap and each layer's window reach the
backend from the config. Gemma 2 is the same layer without q/k norms (`qk_norm` off), one
RoPE base for every layer and soft-capped attention logits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from radixserve.attention.context import ForwardContext

from .config import ModelConfig
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from .rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), in float32, rounded once (transformers' numerics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(DecoderLayer):
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sliding = cfg.window(index) is not None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        a = self.attention_block(self.input_layernorm(h), cos, sin, ctx)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp_block(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(cfg, dtype, device)
        self.local_rotary = self.rotary      # Gemma 2: one RoPE base for every layer
        if cfg.rope_local_theta is not None:
            local = replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
            self.local_rotary = RotaryEmbedding(local, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        dev = self.device
        h = self.embed_tokens(input_ids.to(dev, non_blocking=True))
        # As transformers: the scale is rounded to the working dtype first.
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        positions = positions.to(dev, non_blocking=True)
        full = self.rotary.lookup(positions)
        local = (full if self.local_rotary is self.rotary
                 else self.local_rotary.lookup(positions))
        for layer in self.layers:
            h = layer(h, *(local if layer.sliding else full), ctx)
        logits = self.lm_head(self.norm(h[logits_indices.to(h.device)])).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
