"""load_tokenizer: a model's tokenizer without its weights (or torch).

For a GGUF only the header is read (metadata holds the vocabulary, merges and chat
template; tensor data is never touched); for a Hugging Face directory only its tokenizer
and config files. Tools that only tokenize (the replay of text traces) load in about a
second instead of the model's whole load.
"""

from __future__ import annotations

from .gguf_file import read_gguf_header
from .gguf_tokenizer import gguf_tokenizer
from .registry import resolve_model_path
from .tokenizer import Tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """`model` as `load_model` takes it: a short name, a .gguf file or an HF directory."""
    path = resolve_model_path(model)
    if path.is_dir():
        return Tokenizer.from_directory(path)
    return gguf_tokenizer(read_gguf_header(path).metadata, path)
