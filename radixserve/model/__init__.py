"""Llama-family models over a paged KV pool: loading (GGUF, HF directories), the forward
pass, and the tokenizer with streaming detokenization."""

from .config import ModelConfig
from .detokenizer import IncrementalDetokenizer
from .errors import ModelLoadError
from .llama import LlamaForCausalLM
from .loader import LoadedModel, load_model
from .tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "LlamaForCausalLM", "LoadedModel", "ModelConfig",
           "ModelLoadError", "Tokenizer", "load_model"]
