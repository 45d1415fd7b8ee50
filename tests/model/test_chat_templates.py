"""A Gemma GGUF without `tokenizer.chat_template` gets Gemma's turn format and its
end-of-turn token as an EOS; a file with a template keeps its own; other families get none."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.model.gguf_tokenizer import gguf_tokenizer
from tiny_models import byte_level_vocab

TURN_TOKENS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]


def gemma_like_meta(arch: str, **extra) -> dict:
    tokens, merges = byte_level_vocab()
    tokens = tokens + TURN_TOKENS
    return {"general.architecture": arch, "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if t in TURN_TOKENS else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": tokens.index("<bos>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<eos>"), **extra}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_without_template_gets_gemma_turns(arch):
    meta = gemma_like_meta(arch)
    tok = gguf_tokenizer(meta, Path("unused.gguf"))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there "},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    assert tok.render_chat(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.apply_chat_template(messages)
    tokens = meta["tokenizer.ggml.tokens"]
    # Turn markers are single tokens, BOS written once, and a turn's end stops generation.
    assert ids[:2] == [tokens.index("<bos>"), tokens.index("<start_of_turn>")]
    assert ids.count(tokens.index("<bos>")) == 1
    assert tok.eos_token_ids == {tokens.index("<eos>"), tokens.index("<end_of_turn>")}


def test_a_stored_template_wins_and_other_families_get_none():
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = gguf_tokenizer(gemma_like_meta("gemma3", **{"tokenizer.chat_template": own}),
                         Path("unused.gguf"))
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "x"
    llama = gguf_tokenizer(gemma_like_meta("llama"), Path("unused.gguf"))
    with pytest.raises(ValueError, match="no chat template"):
        llama.render_chat([{"role": "user", "content": "x"}])
