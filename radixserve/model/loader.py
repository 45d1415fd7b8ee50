"""load_model: a short name, a Hugging Face directory or a .gguf file -> LoadedModel.

Offline only: nothing here contacts the Hugging Face hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.phase_timer import PhaseTimer

from .config import ModelConfig
from .dtype import resolve_device, resolve_dtype
from .gguf_loader import load_gguf
from .gguf_tokenizer import gguf_tokenizer
from .hf_loader import load_hf_weights, read_hf_config
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .registry import resolve_model_path
from .tokenizer import Tokenizer
from .weights_cache import WeightsCache


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
               device: str | torch.device = "cpu", weights_cache: WeightsCache | None = None,
               timer: PhaseTimer | None = None) -> LoadedModel:
    """`weights_cache`: where a GGUF's dequantized weights are kept between loads (None:
    dequantize every time). `timer` gets a lap per loading phase."""
    timer = timer or PhaseTimer()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_model_path(model)
    timer.lap("device and dtype")
    if path.is_dir():
        return _load_hf_directory(model, path, dt, dev, timer)
    return _load_gguf_file(model, path, dt, dev, weights_cache, timer)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module implementing `config`'s family (Gemma 3 subclasses the Llama one)."""
    return Gemma3ForCausalLM if config.gemma else LlamaForCausalLM


def _load_gguf_file(name: str, path: Path, dtype: torch.dtype, device: torch.device,
                    weights_cache: WeightsCache | None, timer: PhaseTimer) -> LoadedModel:
    contents = load_gguf(path, dtype)
    timer.lap("GGUF header")
    tokenizer = gguf_tokenizer(contents.metadata, path)
    timer.lap("tokenizer")
    model = model_class(contents.config)(contents.config, dtype=dtype, device=device)
    entry = weights_cache.entry(path, dtype) if weights_cache is not None else None
    if entry is not None and entry.restore(model):
        model.pack_weights()                # the restored parameters are new tensors
        timer.note("weights cache: hit")
    else:
        model.load_weights(contents.weights, str(path))     # dequantizes, tensor by tensor
        if entry is not None:
            timer.note(f"weights cache: {'stored' if entry.save(model) else 'not stored'}")
    timer.lap("weights")
    return LoadedModel(name, contents.config, model.eval(), tokenizer)


def _load_hf_directory(name: str, directory: Path, dtype: torch.dtype, device: torch.device,
                       timer: PhaseTimer) -> LoadedModel:
    config = read_hf_config(directory)
    tokenizer = Tokenizer.from_directory(directory)   # before the weights: fail fast
    timer.lap("tokenizer")
    weights = load_hf_weights(directory, config, dtype)
    model = _build(config, weights, str(directory), dtype, device)
    timer.lap("weights")
    return LoadedModel(name, config, model, tokenizer)


def _build(config: ModelConfig, weights, source: str, dtype: torch.dtype,
           device: torch.device) -> LlamaForCausalLM:
    model = model_class(config)(config, dtype=dtype, device=device)
    model.load_weights(weights, source)
    return model.eval()
