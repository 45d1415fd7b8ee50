"""load_model: a short name, a Hugging Face directory or a .gguf file -> LoadedModel.

Offline only: nothing here contacts the Hugging Face hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .dtype import resolve_device, resolve_dtype
from .gguf_loader import load_gguf
from .gguf_tokenizer import gguf_tokenizer
from .hf_loader import load_hf_weights, read_hf_config
from .llama import LlamaForCausalLM
from .registry import resolve_model_path
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device


def load_model(model: str, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu") -> LoadedModel:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_directory(model, path, dt, dev)
    return _load_gguf_file(model, path, dt, dev)


def _load_gguf_file(name: str, path: Path, dtype: torch.dtype,
                    device: torch.device) -> LoadedModel:
    contents = load_gguf(path, dtype)
    tokenizer = gguf_tokenizer(contents.metadata, path)
    model = _build(contents.config, contents.weights, str(path), dtype, device)
    return LoadedModel(name, contents.config, model, tokenizer)


def _load_hf_directory(name: str, directory: Path, dtype: torch.dtype,
                       device: torch.device) -> LoadedModel:
    config = read_hf_config(directory)
    tokenizer = Tokenizer.from_directory(directory)   # before the weights: fail fast
    weights = load_hf_weights(directory, config, dtype)
    model = _build(config, weights, str(directory), dtype, device)
    return LoadedModel(name, config, model, tokenizer)


def _build(config: ModelConfig, weights, source: str, dtype: torch.dtype,
           device: torch.device) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    model.load_weights(weights, source)
    return model.eval()
