"""GGUF files of every family llama.cpp writes (llama with Mistral's window, qwen2, qwen3,
gemma2) load to the logits of transformers on the stored weights, and of our own load of
the same weights from a Hugging Face directory (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_models import WINDOW
from model_helpers import PagedRunner, hf_logits
from tiny_models import hf_config, random_hf_model, save_hf_dir, write_gguf

ATOL = 1e-3      # as test_hybrid_families; measured below 1e-5 (Gemma: norms stored as 1 + w)

# GGUF architecture -> (transformers model_type, config overrides). Qwen GGUFs carry no
# sliding-window switch (llama.cpp runs them fully), so their configs have none.
GGUF_FAMILIES = {
    "mistral-as-llama": ("llama", "mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", "qwen2", dict()),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=16)),
    "gemma2": ("gemma2", "gemma2", dict(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,  # = head_dim
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
}


@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_gguf_equals_transformers_and_hf_directory(name, tmp_path):
    from transformers import AutoModelForCausalLM
    from radixserve.model.hf_reference import hf_model_for
    from radixserve.model.loader import load_model

    arch, model_type, overrides = GGUF_FAMILIES[name]
    hf_cfg = hf_config(model_type, **overrides)
    model = random_hf_model(hf_cfg)
    stored = write_gguf(tmp_path / "m.gguf", model, arch=arch)
    ref = AutoModelForCausalLM.from_config(hf_cfg).to(torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    ref.tie_weights()
    from_gguf = load_model(str(tmp_path / "m.gguf"), dtype="float32")
    from_dir = load_model(str(save_hf_dir(tmp_path / "hf", ref)), dtype="float32")

    cfg = from_gguf.config
    assert cfg.windows == from_dir.config.windows
    assert (WINDOW in cfg.windows) == ("sliding_window" in overrides)
    assert (cfg.qk_norm, cfg.attention_bias, cfg.attn_logit_softcapping) == (
        from_dir.config.qk_norm, from_dir.config.attention_bias,
        from_dir.config.attn_logit_softcapping)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, hf_cfg.vocab_size, 3 * WINDOW)]
    logits = []
    for loaded in (from_gguf, from_dir):
        runner = PagedRunner(loaded, page_size=4)
        logits.append(runner.step([(runner.new_seq(len(ids)), ids)],
                                  logits_indices=torch.arange(len(ids))))
    assert (logits[0] - hf_logits(ref, ids)).abs().max().item() < ATOL
    assert (logits[0] - logits[1]).abs().max().item() < ATOL
    # The reference the scripts build from our reading of a GGUF (hf_reference) agrees.
    rebuilt = hf_model_for(str(tmp_path / "m.gguf"), from_gguf)
    assert (hf_logits(rebuilt, ids) - logits[0]).abs().max().item() < ATOL
