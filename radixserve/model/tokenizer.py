"""Tokenizer: the engine's view of a Hugging Face tokenizer (encode, chat template,
decode, streaming detokenizer), whichever way it was built (tokenizer files or GGUF)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from .detokenizer import IncrementalDetokenizer
from .errors import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    def __init__(self, hf: Any, eos_token_ids: Iterable[int], bos_token_id: int | None = None):
        self.hf = hf                                   # transformers tokenizer
        self.vocab_size: int = len(hf)                 # ids the tokenizer can produce
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_token_ids)
        self.bos_token_id: int | None = bos_token_id

    @classmethod
    def from_hf(cls, hf: Any, extra_eos: Iterable[int] = ()) -> "Tokenizer":
        eos = set(extra_eos)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        return cls(hf, eos, hf.bos_token_id)

    @classmethod
    def from_directory(cls, directory: str | Path) -> "Tokenizer":
        """Offline load of a model directory's tokenizer files; eos ids also from
        generation_config.json / config.json (Llama 3 lists several)."""
        from transformers import AutoTokenizer

        directory = Path(directory)
        if not any((directory / f).is_file() for f in _TOKENIZER_FILES):
            raise ModelLoadError(
                f"{directory}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})")
        try:
            hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{directory}: cannot load the tokenizer: {e}") from None
        return cls.from_hf(hf, _configured_eos(directory))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: a text of C characters encodes to at
        least C / max_token_chars tokens, which lets the server refuse an oversize prompt
        without tokenizing it (byte-level BPE: an entry's characters are its bytes)."""
        return max(map(len, self.hf.get_vocab()), default=1)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, with the special tokens the tokenizer adds itself (e.g. BOS)."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; send plain prompts instead")
        extra = {"tools": tools} if tools else {}
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **extra)

    @functools.cached_property
    def template_renders_tools(self) -> bool:
        """The chat template takes `tools=` itself (Llama 3.1+, Qwen 2.5, Hermes...)."""
        template = getattr(self.hf, "chat_template", None) or ""
        return isinstance(template, str) and "tools" in template

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        # The template writes BOS etc. itself, so the encoding adds no special tokens.
        text = self.render_chat(messages, add_generation_prompt, tools)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No "clean-up" of spaces before punctuation: it would change the text, and
        # differently for a window than for the whole (breaking streaming).
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, prompt_ids)


def _configured_eos(directory: Path) -> set[int]:
    eos: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((directory / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(int(v) for v in value)
    return eos
