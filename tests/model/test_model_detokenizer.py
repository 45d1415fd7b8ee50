"""Streaming detokenization never emits half a character and adds up to the full text."""

from __future__ import annotations

import pytest

from radixserve.model.detokenizer import IncrementalDetokenizer

TEXTS = [
    "你好，世界！长城是中国古代的军事防御工程。",
    "Rockets 🚀🚀 and families 👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, done.",
    "Mixed: naïve café — 日本語のテキスト 😀 end",
]


def stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [det.push(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_without_replacement_chars(model_fp32, text):
    tok = model_fp32.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text)
    chunks = stream(tok.detokenizer(prompt), ids)
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    # Not vacuous: some character really is split across tokens (a token alone decodes
    # to U+FFFD), so the detokenizer had to hold text back at least once.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert "" in chunks


def test_long_stream_compacts_and_stays_exact(model_fp32):
    tok = model_fp32.tokenizer
    ids = tok.encode(" ".join(TEXTS) * 20)           # > the compaction threshold
    det = tok.detokenizer()
    assert "".join(stream(det, ids)) + det.flush() == tok.decode(ids)


def test_incomplete_character_held_back_until_flush(model_fp32):
    tok = model_fp32.tokenizer
    ids = tok.encode("ok 🚀")
    # Find a cut inside the emoji: the decoded prefix ends in U+FFFD.
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    det = tok.detokenizer()
    out = "".join(stream(det, ids[:cut]))
    partial = tok.decode(ids[:cut])
    assert "\ufffd" not in out and partial.startswith(out) and out.startswith("ok")
    assert out + det.flush() == partial          # flush shows what a full decode shows


def test_special_tokens_are_skipped(model_fp32):
    tok = model_fp32.tokenizer
    ids = tok.encode("Hi there") + [2]
    assert "".join(stream(tok.detokenizer(), ids)) == "Hi there"


def test_sentencepiece_style_leading_space_is_kept():
    """With a decoder that strips a leading space from a window's first piece (as
    SentencePiece does), the window technique keeps the spaces between words."""
    vocab = {0: "▁Hello", 1: "▁world", 2: "!"}

    def decode(ids):
        return "".join(vocab[i] for i in ids).replace("▁", " ").lstrip(" ")

    det = IncrementalDetokenizer(decode, prompt_ids=[0])
    assert [det.push(1), det.push(2)] == [" world", "!"]
