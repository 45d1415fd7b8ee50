"""Drive LlamaForCausalLM directly over a KVPool with the torch attention backend.

Pages come from a shuffled list (no allocator or radix tree: these tests are about the
model), so page tables are non-contiguous as they are in a server.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.attention import SeqSpan, build_metadata, create_backend
from radixserve.attention.context import ForwardContext
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.mla_torch import MLATorchBackend


def latent_pool_and_backend(loaded, num_pages: int, page_size: int, absorbed: bool = True):
    """A LatentKVPool for a DeepSeek model and the MLA torch backend."""
    cfg = loaded.config
    pool = LatentKVPool(cfg.num_layers, num_pages, page_size, cfg.mla.kv_lora_rank,
                        cfg.mla.qk_rope_head_dim, loaded.dtype, loaded.device)
    return pool, MLATorchBackend(num_heads=cfg.num_heads, absorbed=absorbed)


@dataclass
class Seq:
    pages: np.ndarray
    cached_len: int = 0


class PagedRunner:
    def __init__(self, loaded, page_size: int = 1, num_tokens: int = 2048, seed: int = 0):
        cfg = loaded.config
        self.model, self.page_size = loaded.model, page_size
        num_pages = -(-num_tokens // page_size)
        if cfg.mla is not None:         # DeepSeek: latent pages, the MLA torch backend
            self.pool, self.backend = latent_pool_and_backend(loaded, num_pages, page_size)
        else:
            self._full_kv(loaded, num_pages, page_size)
        self._free = list(np.random.default_rng(seed).permutation(num_pages).astype(np.int32))

    def _full_kv(self, loaded, num_pages: int, page_size: int) -> None:
        cfg = loaded.config
        self.pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads,
                           cfg.head_dim, loaded.dtype, loaded.device)
        self.backend = create_backend("torch", num_qo_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      dtype=loaded.dtype, device=loaded.device,
                                      sm_scale=cfg.attention_scale,
                                      layer_windows=cfg.layer_windows,
                                      logits_soft_cap=cfg.attn_logit_softcapping)

    def new_seq(self, max_tokens: int) -> Seq:
        n = -(-max_tokens // self.page_size)
        pages, self._free = np.array(self._free[:n], dtype=np.int32), self._free[n:]
        assert len(pages) == n, "test pool too small"
        return Seq(pages)

    def step(self, work: list[tuple[Seq, list[int]]],
             logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over several sequences' new tokens (prefill chunks first)."""
        spans = [SeqSpan(s.pages, s.cached_len, len(toks)) for s, toks in work]
        ids = torch.tensor([t for _, toks in work for t in toks], dtype=torch.int64)
        pos = torch.cat([torch.arange(s.cached_len, s.cached_len + len(toks))
                         for s, toks in work])
        meta = build_metadata(spans, self.page_size, self.model.device)
        ctx = ForwardContext.prepare(self.backend, meta, self.pool)
        rows = meta.last_token_rows() if logits_indices is None else logits_indices
        logits = self.model(ids, pos, ctx, rows)
        for s, toks in work:
            s.cached_len += len(toks)
        return logits

    def greedy(self, prompt: list[int], max_new: int,
               stop: frozenset[int] = frozenset()) -> list[int]:
        seq = self.new_seq(len(prompt) + max_new)
        out: list[int] = []
        nxt = int(self.step([(seq, list(prompt))])[0].argmax())
        while True:
            out.append(nxt)
            if len(out) == max_new or nxt in stop:
                return out
            nxt = int(self.step([(seq, [nxt])])[0].argmax())


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits for every position of one sequence: [len(ids), vocab]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy `generate`, exactly max_new tokens: the model's
    generation_config must have no eos_token_id (min_new_tokens would not do: it masks
    EOS out of the argmax)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), generation_config=gen,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out.shape[1] == len(prompt) + max_new
    return out[0, len(prompt):].tolist()
