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
from .deepseek import DeepseekForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .quantized_linear import Int4Groups
from .registry import resolve_model_path
from .tokenizer import Tokenizer
from .weights_cache import WeightsCache
from .weights_dtype import GroupsFor, describe_form, precision_class, quantize_model, \
    resolve_weights_dtype, weight_bytes


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    weights_dtype: str = "bf16"          # bf16 (the model's dtype), int8, int4, int4+float
    file_tensor_bytes: int | None = None   # a GGUF's tensor data, for the memory line

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def describe_weights(self) -> str:
        """The start-up line: weights form and resident bytes (vs the GGUF's tensors)."""
        size = weight_bytes(self.model)
        form = describe_form(self.weights_dtype, self.dtype)
        line = f"weights: {form}, {size / 2**20:.1f} MiB ({size} bytes)"
        if self.file_tensor_bytes:
            line += (f", {size / self.file_tensor_bytes:.2f}x the GGUF's "
                     f"{self.file_tensor_bytes / 2**20:.1f} MiB of tensors")
        return line


def load_model(model: str, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", weights_cache: WeightsCache | None = None,
               timer: PhaseTimer | None = None, weights_dtype: str = "bf16") -> LoadedModel:
    """`weights_cache`: where a GGUF's dequantized weights are kept between loads (None:
    dequantize every time). `timer` gets a lap per loading phase. `weights_dtype`: auto,
    bf16 (the model's dtype), int8 or int4 (weights_dtype.py)."""
    timer = timer or PhaseTimer()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_model_path(model)
    timer.lap("device and dtype")
    if path.is_dir():
        return _load_hf_directory(model, path, dt, dev, timer, weights_dtype)
    return _load_gguf_file(model, path, dt, dev, weights_cache, timer, weights_dtype)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module implementing `config`'s family (Gemma 3 subclasses the Llama one)."""
    if config.mla is not None:
        return DeepseekForCausalLM
    return Gemma3ForCausalLM if config.gemma else LlamaForCausalLM


def _load_gguf_file(name: str, path: Path, dtype: torch.dtype, device: torch.device,
                    weights_cache: WeightsCache | None, timer: PhaseTimer,
                    weights_dtype: str) -> LoadedModel:
    contents = load_gguf(path, dtype)
    kind = resolve_weights_dtype(weights_dtype, precision_class(contents.weight_types.values()),
                                 device, dtype)
    timer.lap("GGUF header")
    tokenizer = gguf_tokenizer(contents.metadata, path)
    timer.lap("tokenizer")
    model = model_class(contents.config)(contents.config, dtype=dtype, device=device)
    quantize_model(model, kind, fill=False)    # a quantized skeleton for the cache to fill
    entry = weights_cache.entry(path, dtype, kind) if weights_cache is not None else None
    if entry is not None and entry.restore(model):
        model.pack_weights()                # the restored parameters are new tensors
        timer.note("weights cache: hit")
    else:
        model = model_class(contents.config)(contents.config, dtype=dtype, device=device)
        model.load_weights(contents.weights, str(path))     # dequantizes, tensor by tensor
        quantize_model(model, kind, _file_groups(model, contents.int4_groups))
        if entry is not None:
            timer.note(f"weights cache: {'stored' if entry.save(model) else 'not stored'}")
    timer.lap("weights")
    return LoadedModel(name, contents.config, model.eval(), tokenizer, kind,
                       contents.tensor_bytes)


def _file_groups(model: LlamaForCausalLM, int4_groups) -> GroupsFor:
    """Module name -> the GGUF's own int4 blocks for all the weights it stacks, or None."""
    sources = model.linear_sources()

    def groups_for(name: str) -> Int4Groups | None:
        parts = [int4_groups(n) for n in sources.get(name, ())]
        if not parts or any(p is None for p in parts):
            return None
        return Int4Groups.cat(parts)
    return groups_for


def _load_hf_directory(name: str, directory: Path, dtype: torch.dtype, device: torch.device,
                       timer: PhaseTimer, weights_dtype: str) -> LoadedModel:
    config = read_hf_config(directory)
    kind = resolve_weights_dtype(weights_dtype, "bf16", device, dtype)
    tokenizer = Tokenizer.from_directory(directory)   # before the weights: fail fast
    timer.lap("tokenizer")
    weights = load_hf_weights(directory, config, dtype)
    model = _build(config, weights, str(directory), dtype, device)
    quantize_model(model, kind)                 # quantized on load when asked
    timer.lap("weights")
    return LoadedModel(name, config, model, tokenizer, kind)


def _build(config: ModelConfig, weights, source: str, dtype: torch.dtype,
           device: torch.device) -> LlamaForCausalLM:
    model = model_class(config)(config, dtype=dtype, device=device)
    model.load_weights(weights, source)
    return model.eval()
