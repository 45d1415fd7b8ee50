"""Checkpoints users bring: HF directories (llama, qwen2, mistral) and llama GGUF files,
each a tiny random model written to tmp_path, loaded by load_model, compared with
transformers on the same weights (fp32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model_helpers import PagedRunner, hf_greedy, hf_logits
from radixserve.model import load_model
from radixserve.model.config import ModelConfig
from tiny_models import hf_config, random_hf_model, save_hf_dir, write_gguf

ATOL = 1e-4       # logits of these tiny models are O(1..10); fp32 rounding is ~1e-6
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 50000.0}

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama3-rope-attention-bias-head-dim": (
        "llama", {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "head_dim": 32}),
    "llama-linear-rope-tied": (
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                      "rope_theta": 10000.0}, "tie_word_embeddings": True}),
    "qwen2-qkv-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
}
PROMPT = list(range(40, 40 + 70))        # 70 tokens: past llama3's original context (64)


def compare(loaded, hf_model, page_size: int = 4) -> None:
    runner = PagedRunner(loaded, page_size=page_size)
    seq = runner.new_seq(len(PROMPT))
    ours = runner.step([(seq, PROMPT)], logits_indices=torch.arange(len(PROMPT)))
    ref = hf_logits(hf_model, PROMPT)
    assert ref.abs().max() > 1.0                     # peaked enough for the test to bite
    assert (ours - ref).abs().max().item() < ATOL
    assert runner.greedy(PROMPT[:10], 12) == hf_greedy(hf_model, PROMPT[:10], 12)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_directory_matches_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    hf_model = random_hf_model(hf_config(arch, **overrides))
    directory = save_hf_dir(tmp_path / case, hf_model)
    loaded = load_model(str(directory), dtype="float32")
    assert loaded.config.model_type == arch
    assert loaded.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    expect_bias = arch == "qwen2" or overrides.get("attention_bias", False)
    assert loaded.config.attention_bias == expect_bias
    compare(loaded, hf_model)
    # The tokenizer came from the directory's files.
    tok = loaded.tokenizer
    assert tok.decode(tok.encode("the cat")) == "the cat"
    assert tok.eos_token_ids == {hf_model.config.vocab_size - 1}


def test_sharded_safetensors_directory(tmp_path):
    hf_model = random_hf_model(hf_config("llama"))
    directory = save_hf_dir(tmp_path / "sharded", hf_model, max_shard_size="100KB")
    assert (directory / "model.safetensors.index.json").is_file()
    compare(load_model(str(directory), dtype="float32"), hf_model)


@pytest.mark.parametrize("bias", [False, True])
def test_gguf_file_with_permuted_qk_and_q8_0(tmp_path, bias):
    """A llama.cpp-layout GGUF (q/k rows and biases permuted, some tensors Q8_0) loads and
    equals transformers on the dequantized weights: checks the un-permutation
    independently of the SmolLM2 file."""
    from transformers import LlamaForCausalLM
    hf_model = random_hf_model(hf_config("llama", tie_word_embeddings=True, attention_bias=bias))
    path = tmp_path / "tiny.gguf"
    stored = write_gguf(path, hf_model, q8_names=("token_embd.weight", "blk.1.ffn_down.weight"))
    ref = LlamaForCausalLM(hf_model.config).eval()
    ref.load_state_dict(stored, strict=False)
    ref.tie_weights()
    ref.generation_config.eos_token_id = None
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.tie_word_embeddings
    assert loaded.config.attention_bias == loaded.config.o_proj_bias == bias
    compare(loaded, ref, page_size=1)
    assert loaded.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == \
        "<s>user: hi</s><s>assistant: "


def test_gguf_rope_freqs_equal_llama3_scaling(tmp_path):
    """Llama-3 GGUFs carry rope scaling as per-dimension factors (rope_freqs); computed as
    llama.cpp's converter does, they must reproduce transformers' llama3 scaling."""
    cfg = hf_config("llama", rope_parameters=LLAMA3_ROPE, head_dim=16)
    hf_model = random_hf_model(cfg)
    s = LLAMA3_ROPE
    dim = cfg.head_dim
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    factors = []
    for f in freqs:                                  # convert_hf_to_gguf.py, LlamaModel
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(s["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    path = tmp_path / "llama3.gguf"
    write_gguf(path, hf_model, rope_freqs=np.array(factors))
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    compare(loaded, hf_model, page_size=16)


def test_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from radixserve.model.rope import inv_frequencies
    for params in (LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}):
        hf = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=params,
                         max_position_embeddings=512)
        ref, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
        ours = inv_frequencies(ModelConfig.from_hf_config(hf.to_dict()))
        assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)


def test_config_accepts_transformers_4_keys_and_keeps_sliding_window():
    v4 = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100,
          "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
          "max_position_embeddings": 32768, "sliding_window": 4096}
    cfg = ModelConfig.from_hf_config(v4)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    # The window is honoured per layer (Mistral: every layer); the context is not cut.
    assert cfg.max_position_embeddings == 32768 and cfg.layer_windows == (4096, 4096)
    qwen = dict(v4, model_type="qwen2", use_sliding_window=False)
    assert ModelConfig.from_hf_config(qwen).max_position_embeddings == 32768
    assert ModelConfig.from_hf_config(qwen).layer_windows is None
    assert ModelConfig.from_hf_config(qwen).attention_bias
