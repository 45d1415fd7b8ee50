"""Model-test fixtures: a transformers reference for SmolLM2 built by transformers' own
GGUF reader (its own config parsing, dequantization and q/k un-permutation), so nothing
of ours is shared with the reference except the `gguf` package's dequantizer."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.registry import resolve_short_name


@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_short_name("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_reference(smollm2_path):
    """(transformers LlamaForCausalLM in float32, its HF-named state dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(smollm2_path), return_tensors=False)
    raw = {k: v for k, v in parsed["config"].items()
           if k not in ("model_type", "architectures", "_model_name_or_path")}
    config = LlamaConfig(**raw)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(smollm2_path), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config).to(torch.float32)
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys  # tied
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config.eos_token_id = None   # greedy tests compare fixed lengths
    model.eval()
    return model, tensors
