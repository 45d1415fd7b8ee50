"""LlamaForCausalLM over a flat token batch whose attention reads K/V from pages.

One forward call computes any mix of prefill chunks and decodes: tokens of all sequences
are concatenated ([T]); only attention needs to know which token belongs to which
sequence, and it learns that from the step's metadata through the backend. q/k/v and
gate/up are fused into one matmul each (fewer, larger GEMMs are faster on CPU and GPU).
Covers Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms) and SmolLM; sliding-window
layers differ only in the attention backend (it knows each layer's window). Gemma 3
(`gemma3.py`) reuses the attention and MLP blocks here.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.context import ForwardContext

from .config import ModelConfig
from .packed_linear import Linear
from .rope import RotaryEmbedding, rotate_in_place
from .weights import check_weights


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # Nothing to round between the norm and the scale: one call, the same bits
            # (x * rsqrt(mean(x^2) + eps) * w), ~4 us less per norm on CPU.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # As transformers: normalise in float32, round, then scale in the working dtype.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * y


class DecoderLayer(nn.Module):
    norm_class: type[nn.Module] = RMSNorm     # Gemma's layer swaps in its (1 + w) norm

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.split = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:     # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE
            self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = h + self.attention_block(self.input_layernorm(h), cos, sin, ctx)
        return h + self.mlp_block(self.post_attention_layernorm(h))

    def attention_block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        ctx: ForwardContext) -> torch.Tensor:
        """Normalised hidden states -> the attention output after o_proj."""
        t, hq, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # q and k are adjacent in each row: rotated together, in place (views of qkv).
        qk = qkv[:, :self.split[0] + self.split[1]].view(t, hq + self.num_kv_heads, d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])], dim=1)
        rotate_in_place(qk, cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, self.split[0] + self.split[1]:].view(t, self.num_kv_heads, d)
        o = ctx.attention(self.index, q, k, v)
        return self.o_proj(o.reshape(t, -1))

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # In place in the projection's output: the same bits as silu(gate) * up without
        # two [T, intermediate] temporaries.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaForCausalLM(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.config = cfg
        with torch.device("meta"):     # no init cost: load_weights fills everything
            # _weight: no random init (normal_ on meta imports ~800 torch modules, ~1 s)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.layers = nn.ModuleList(self.layer_class(cfg, i)
                                        for i in range(cfg.num_layers))
            self.norm = self.layer_class.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to(dtype)                 # still on meta: free
        self.to_empty(device=device)   # one uninitialised allocation in the final dtype
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, dtype, device)

    def pack_weights(self) -> None:
        """Give every linear its oneDNN-packed weight (CPU bf16/fp16; else a no-op): call
        once the weights are in place (load_weights does; so does the loader after the
        weights cache hands its tensors over)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.repack()

    def linear_sources(self) -> dict[str, tuple[str, ...]]:
        """Module name of each decoder linear -> the HF weights it stacks (row-wise), for
        loaders that hand quantized layers the file's own blocks (weights_dtype.py)."""
        out = {}
        for i in range(self.config.num_layers):
            p, m = f"model.layers.{i}.", f"layers.{i}."
            out[m + "qkv_proj"] = tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")
            out[m + "o_proj"] = (p + "self_attn.o_proj.weight",)
            out[m + "gate_up_proj"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            out[m + "down_proj"] = (p + "mlp.down_proj.weight",)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: embeddings may be quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions int64 [T] -> float32 logits [len(logits_indices), vocab].

        logits_indices: the rows of the step's flat tokens to compute logits for (each
        sequence's last token: `ctx.meta.last_token_rows()`)."""
        dev = self.device
        h = self.embed_tokens(input_ids.to(dev, non_blocking=True))
        cos, sin = self.rotary.lookup(positions.to(dev, non_blocking=True))
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        h = self.norm(h[logits_indices.to(h.device)])   # norm is per token: select first
        return self.lm_head(h).float()

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], source: str = "weights") -> None:
        """Copy HF-named tensors in (checked first), fusing q/k/v and gate/up."""
        cfg = self.config
        check_weights(cfg, weights, source)
        self.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.copy_(weights["model.norm.weight"])
        if not cfg.tie_word_embeddings:
            self.lm_head.weight.copy_(weights["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."

            def w(name: str) -> torch.Tensor:
                return weights[p + name]

            for name, norm in layer.named_children():
                if name.endswith(("layernorm", "_norm")):   # every norm, whichever family
                    norm.weight.copy_(w(("self_attn." if name in ("q_norm", "k_norm") else "")
                                        + name + ".weight"))

            attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            layer.qkv_proj.weight.copy_(torch.cat([w(n + ".weight") for n in attn]))
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([w(n + ".bias") for n in attn]))
            layer.o_proj.weight.copy_(w("self_attn.o_proj.weight"))
            if cfg.o_proj_bias:
                layer.o_proj.bias.copy_(w("self_attn.o_proj.bias"))
            layer.gate_up_proj.weight.copy_(
                torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
            layer.down_proj.weight.copy_(w("mlp.down_proj.weight"))
            if cfg.mlp_bias:
                layer.gate_up_proj.bias.copy_(
                    torch.cat([w("mlp.gate_proj.bias"), w("mlp.up_proj.bias")]))
                layer.down_proj.bias.copy_(w("mlp.down_proj.bias"))
        self.pack_weights()
