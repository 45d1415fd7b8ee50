"""Read a Hugging Face model directory: config.json and *.safetensors (HF names kept).

Every tensor's name and shape is checked against the config from the file headers before
any data is read; data is then read tensor by tensor as the model copies it in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ModelLoadError
from .weights import LazyWeights, check_weights


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return ModelConfig.from_hf_config(raw)


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable index ({e})") from None
        files = [directory / n for n in shard_names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{directory}: missing shard file(s) {', '.join(absent[:3])}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {', '.join(others[:3])}; only safetensors is supported)" if others else ""
        raise ModelLoadError(f"{directory}: no *.safetensors weight files{hint}")
    return files


def load_hf_weights(directory: Path, config: ModelConfig, dtype: torch.dtype) -> LazyWeights:
    """Checked, lazily read weights: tensor data is read (and cast) on access."""
    from safetensors import safe_open

    owner: dict[str, object] = {}          # name -> open file handle (kept open by this)
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for f in safetensors_files(directory):
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                owner[name] = handle
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{directory}: unreadable safetensors file: {e}") from None
    check_weights(config, shapes, str(directory))
    return LazyWeights(shapes, lambda name: owner[name].get_tensor(name).to(dtype))
