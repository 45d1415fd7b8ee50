"""The converted-tokenizer cache (model/tokenizer_cache.py): the converter runs once per
file; the cached tokenizer encodes and renders chats as the converted one; a changed file
or a damaged entry is converted again."""

from __future__ import annotations

from tiny_models import tiny_tokenizer

from radixserve.model.tokenizer_cache import cached_tokenizer

TEXT = "the quick brown fox, 1234  jumps</s>"


def test_converted_once_then_read_back(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    calls = []

    def convert():
        calls.append(1)
        return tiny_tokenizer()

    first = cached_tokenizer(gguf, convert, cache_dir=tmp_path / "cache")
    again = cached_tokenizer(gguf, convert, cache_dir=tmp_path / "cache")
    assert len(calls) == 1
    assert again(TEXT).input_ids == first(TEXT).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(chat, tokenize=False) == \
        first.apply_chat_template(chat, tokenize=False)
    assert (again.bos_token, again.eos_token) == (first.bos_token, first.eos_token)

    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")          # damaged: rebuilt
    cached_tokenizer(gguf, convert, cache_dir=tmp_path / "cache")
    gguf.write_bytes(b"another GGUF")                             # another file: converted
    cached_tokenizer(gguf, convert, cache_dir=tmp_path / "cache")
    assert len(calls) == 3
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
