"""Build a Hugging Face fast tokenizer from GGUF metadata (the `tokenizer.ggml.*` keys).

Byte-level BPE vocabularies ("gpt2" model) with a pre-tokenizer we know are built directly
from the already-parsed metadata (no second pass over the file). The pre-tokenizer is
chosen from `tokenizer.ggml.pre` as llama.cpp does: "smollm" and its relatives split every
digit first, which transformers' own GGUF converter omits (it would tokenize "c333  4"
differently from the original tokenizer). Anything else falls back to transformers'
converter, offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .chat_templates import DEFAULT_CHATS
from .errors import ModelLoadError
from .tokenizer import Tokenizer
from .tokenizer_cache import cached_tokenizer

# llama.cpp pre-tokenizer names whose regexes are "split each digit, then GPT-2's regex".
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva"}
_GPT2 = {"gpt2", "mpt", "olmo", "jais", "default"}

_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types


def tokenizer_from_gguf(meta: Mapping[str, Any], path: Path):
    """-> a transformers PreTrainedTokenizerFast carrying the chat template."""
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre in _DIGITS_THEN_GPT2 | _GPT2:
        return _byte_level_bpe(meta, digits_first=pre in _DIGITS_THEN_GPT2)
    return _transformers_converter(path)


def _byte_level_bpe(meta: Mapping[str, Any], digits_first: bool):
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tk = RustTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                              fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.pre_tokenizer = (pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
        if digits_first else byte_level)
    tk.decoder = decoders.ByteLevel()
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == _USER_DEFINED])
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t == _CONTROL])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), chat_template=meta.get("tokenizer.chat_template"))


def _transformers_converter(path: Path):
    """transformers' converter (slow for large SentencePiece vocabularies: cached)."""
    def convert():
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata: "
                                 f"{e}") from None

    return cached_tokenizer(path, convert)


def gguf_tokenizer(meta: Mapping[str, Any], path: Path) -> Tokenizer:
    """The engine's Tokenizer for a GGUF file, from its (already read) metadata; a file
    without a chat template gets its family's default where there is one (chat_templates)."""
    hf, eos = tokenizer_from_gguf(meta, path), gguf_eos_ids(meta)
    default = DEFAULT_CHATS.get(str(meta.get("general.architecture")))
    if default is not None and not getattr(hf, "chat_template", None):
        hf.chat_template = default.template
        end = hf.convert_tokens_to_ids(default.end_of_turn)
        if end is not None and end != hf.unk_token_id:
            eos.add(int(end))
    return Tokenizer.from_hf(hf, eos)


def gguf_eos_ids(meta: Mapping[str, Any]) -> set[int]:
    """End-of-sequence ids: eos plus end-of-turn/end-of-message where the file names them."""
    return {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if meta.get(k) is not None}
