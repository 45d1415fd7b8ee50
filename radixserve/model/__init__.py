"""Llama-family models over a paged KV pool: loading (GGUF, HF directories), the forward
pass, and the tokenizer with streaming detokenization.

Names are imported on first use (PEP 562), so `load_tokenizer` and the tokenizer classes
come without torch: a tool that only tokenizes does not pay for importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "IncrementalDetokenizer": ".detokenizer",
    "LlamaForCausalLM": ".llama",
    "LoadedModel": ".loader",
    "ModelConfig": ".config",
    "ModelLoadError": ".errors",
    "Tokenizer": ".tokenizer",
    "load_model": ".loader",
    "load_tokenizer": ".tokenizer_loader",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .config import ModelConfig
    from .detokenizer import IncrementalDetokenizer
    from .errors import ModelLoadError
    from .llama import LlamaForCausalLM
    from .loader import LoadedModel, load_model
    from .tokenizer import Tokenizer
    from .tokenizer_loader import load_tokenizer


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
