"""DeepSeek-V2/V3 (and V2-Lite) over latent KV pages: multi-head latent attention (MLA)
and the MoE feed-forward, on the Llama model's skeleton (embeddings, final norm, head).

Attention per layer: q from one projection (q_lora_rank None, V2-Lite) or a low-rank pair
with an RMSNorm between (q_a_proj, q_a_layernorm, q_b_proj); the KV side projects the
hidden state to a latent (kv_lora_rank, normalised by kv_a_layernorm) and one decoupled
RoPE key shared by all heads (kv_a_proj_with_mqa). Only those two are cached
(``LatentKVPool``); ``kv_b_proj`` (``LatentProjections``) turns latents into per-head
keys and values, or, absorbed, moves the query into latent space (``mla_torch``).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from radixserve.attention.context import ForwardContext
from radixserve.attention.mla_weights import LatentProjections

from .config import ModelConfig
from .deepseek_rope import LatentRotary
from .llama import LlamaForCausalLM, RMSNorm
from .moe import MoE, GatedMLP
from .packed_linear import Linear
from .weights import check_weights


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        m = cfg.mla
        self.index, self.num_heads, self.mla = index, cfg.num_heads, m
        q_out = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = LatentProjections(cfg.num_heads, m.qk_nope_head_dim, m.v_head_dim,
                                           m.kv_lora_rank, m.softmax_scale())
        self.o_proj = Linear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: LatentRotary, ctx: ForwardContext) -> torch.Tensor:
        m, t = self.mla, x.shape[0]
        q = (self.q_proj(x) if m.q_lora_rank is None
             else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))))
        q = q.view(t, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        latent = self.kv_a_proj_with_mqa(x)
        ckv = self.kv_a_layernorm(latent[:, :m.kv_lora_rank])
        kpe = rotary.rotate(latent[:, None, m.kv_lora_rank:], cos, sin)[:, 0]
        o = ctx.latent_attention(self.index, q_nope, rotary.rotate(q_pe, cos, sin), ckv, kpe,
                                 self.kv_b_proj)
        return self.o_proj(o.reshape(t, -1))


class DeepseekDecoderLayer(nn.Module):
    norm_class = RMSNorm

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(index)
        self.mlp = (MoE(cfg.moe, cfg.hidden_size) if moe
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size))
        self.rotary: LatentRotary | None = None     # the model's, set after construction

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, self.rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM; forward is the Llama one."""
    layer_class = DeepseekDecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(cfg, dtype, device)
        for layer in self.layers:          # router weights stay float32, as transformers'
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.float()
        self.rotary = LatentRotary(cfg.mla, cfg.rope_theta, cfg.max_position_embeddings,
                                   dtype, device)
        for layer in self.layers:
            layer.rotary = self.rotary

    def linear_sources(self) -> dict[str, tuple[str, ...]]:
        return {}          # GGUF int4 blocks: none (DeepSeek loads from HF directories)

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], source: str = "weights") -> None:
        """Copy HF-named tensors in (checked first), fusing each MLP's gate and up."""
        check_weights(self.config, weights, source)
        self.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.copy_(weights["model.norm.weight"])
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(weights["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            for name, param in layer.named_parameters():
                hf = _hf_name(name)
                if hf is not None:
                    param.copy_(weights[prefix + hf])
            for name, module in layer.named_modules():
                if isinstance(module, GatedMLP):
                    module.gate_up_proj.weight.copy_(torch.cat(
                        [weights[f"{prefix}{name}.{x}_proj.weight"] for x in ("gate", "up")]))
        self.pack_weights()


def _hf_name(param: str) -> str | None:
    """Our parameter name -> the checkpoint's (None: fused gate/up, loaded separately)."""
    return None if "gate_up_proj" in param else param
