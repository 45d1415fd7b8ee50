"""load_model: a short name, a Hugging Face directory or a .gguf file -> LoadedModel.

Offline only: nothing here contacts the Hugging Face hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .dtype import resolve_device, resolve_dtype
from .errors import ModelLoadError
from .gguf_loader import load_gguf
from .gguf_tokenizer import gguf_eos_ids, tokenizer_from_gguf
from .hf_loader import load_hf_weights, read_hf_config
from .llama import LlamaForCausalLM
from .registry import SHORT_NAMES, resolve_short_name
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
    path = resolve_short_name(model)
    if path is None:
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model {model!r} not found: not a short name ({', '.join(SHORT_NAMES)}), "
                f"a directory, or a .gguf file")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            path = ggufs[0]
        else:
            return _load_hf_directory(model, path, dt, dev)
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    return _load_gguf_file(model, path, dt, dev)


def _load_gguf_file(name: str, path: Path, dtype: torch.dtype,
                    device: torch.device) -> LoadedModel:
    contents = load_gguf(path, dtype)
    hf_tok = tokenizer_from_gguf(contents.metadata, path)
    tokenizer = Tokenizer.from_hf(hf_tok, gguf_eos_ids(contents.metadata))
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
