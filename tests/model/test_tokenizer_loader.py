"""load_tokenizer: the same tokenizer as load_model's, built without the weights or torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import hf_config, random_hf_model, save_hf_dir, write_gguf

from radixserve.model import ModelLoadError, load_model, load_tokenizer
from radixserve.model.gguf_file import read_gguf_header

MESSAGES = [{"role": "user", "content": "What is 2+2? Say it in 3 words."}]


def test_smollm2_tokenizer_matches_the_full_load(model_fp32):
    tok, full = load_tokenizer("smollm2-135m-instruct"), model_fp32.tokenizer
    text = "Hello world, 12345 and ü: c333  4 <|im_end|>"
    assert tok.encode(text) == full.encode(text)
    assert tok.apply_chat_template(MESSAGES) == full.apply_chat_template(MESSAGES)
    assert (tok.eos_token_ids, tok.bos_token_id, tok.vocab_size) == (
        full.eos_token_ids, full.bos_token_id, full.vocab_size)


def test_loading_a_tokenizer_imports_neither_torch_nor_a_weight_reader():
    """Run in a fresh interpreter: the weight readers (and torch) are never even imported,
    so no tensor can have been read."""
    code = (
        "import json, sys\n"
        "from radixserve.model import load_tokenizer\n"
        "tok = load_tokenizer('smollm2-135m-instruct')\n"
        "mods = [m for m in ('torch', 'radixserve.model.gguf_loader', 'radixserve.model.weights',"
        " 'radixserve.model.hf_loader', 'radixserve.model.llama') if m in sys.modules]\n"
        "print(json.dumps({'ids': tok.encode('Hello'), 'imported': mods}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    assert result["ids"] == [19556]


@pytest.fixture
def tiny_model():
    return random_hf_model(hf_config("llama"))


def test_gguf_tokenizer_reads_only_the_header(tmp_path, tiny_model):
    """A GGUF cut right after its header has no tensor data: load_model refuses it,
    load_tokenizer still builds the full tokenizer."""
    whole, cut = tmp_path / "whole.gguf", tmp_path / "cut.gguf"
    write_gguf(whole, tiny_model)
    first = min(t.offset for t in read_gguf_header(whole).tensors.values())
    cut.write_bytes(whole.read_bytes()[:first])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(cut), dtype="float32")
    expected = load_tokenizer(str(whole))
    tok = load_tokenizer(str(cut))
    assert tok.encode("the theme") == expected.encode("the theme") != []
    assert tok.render_chat(MESSAGES) == expected.render_chat(MESSAGES)
    assert tok.eos_token_ids == expected.eos_token_ids == {tok.vocab_size - 1}


def test_hf_directory_tokenizer_needs_no_weight_files(tmp_path, tiny_model):
    directory = save_hf_dir(tmp_path / "m", tiny_model)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no .*safetensors"):
        load_model(str(directory), dtype="float32")
    tok = load_tokenizer(str(directory))
    assert tok.decode(tok.encode("the theme")) == "the theme"
    assert tok.eos_token_ids == {tok.vocab_size - 1}


def test_unknown_model_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_tokenizer(str(tmp_path / "nothing-here"))
