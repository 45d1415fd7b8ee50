"""The SmolLM2 tokenizer built from GGUF metadata, and its chat template."""

from __future__ import annotations

import pytest

TEXTS = [
    "Hello world, how are you?",
    "你好，世界！今天天气很好。",
    "Emoji: 🙂🚀👩‍👩‍👧 and ü, é, ß.",
    "def f(x):\n    return x ** 2  # tabs\tand  spaces\n\n",
]


@pytest.fixture(scope="module")
def tok(model_fp32):
    return model_fp32.tokenizer


def test_special_ids_from_metadata(tok):
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})          # <|im_end|> ends a chat turn
    assert tok.vocab_size == 49152
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_matches_transformers_gguf_converter(tok, smollm2_path):
    """Same ids as transformers' independent GGUF tokenizer converter on text where the
    two pre-tokenizers agree (no digits)."""
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                        local_files_only=True)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=True), text


def test_digits_are_split_one_by_one(tok):
    """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) split every digit
    before BPE; transformers' GGUF converter misses this ("c333  4" differs)."""
    ids = tok.encode("in 2024 we sold 12345 units; c333  4")
    pieces = [tok.decode([i]) for i in ids]
    assert tok.decode(ids) == "in 2024 we sold 12345 units; c333  4"
    assert all(sum(ch.isdigit() for ch in p) <= 1 for p in pieces), pieces
    assert "  " in pieces            # the double space stays one token, as in SmolLM2


def test_chat_template_is_chatml_with_default_system(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.render_chat(msgs)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2   # three turns opened
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert not tok.render_chat(msgs, add_generation_prompt=False).endswith("assistant\n")
