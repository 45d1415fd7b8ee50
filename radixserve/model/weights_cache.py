"""WeightsCache: a model's parameters as loaded from a GGUF, kept on disk between starts.

Loading SmolLM2's Q4_1 GGUF dequantizes 135M weights (~1.8 s on 2 cores) and copies them
into the model (~0.5 s, mostly page faults). From a cache entry the parameters instead
become views of the entry's file mapping: checking it (sha256 of the GGUF, crc32 of the
entry) takes ~0.2 s and nothing is copied; the pages come from the OS page cache, shared
by every process that maps the entry.

The key is the GGUF's sha256, the dtype, and a fingerprint of the code that turns a GGUF
into parameters (our loader and model modules, the `gguf` dequantizer, torch's version):
a changed file or changed code never matches an old entry. Entries are checked safetensors
files (`checked_safetensors.py`): written atomically and crc32-verified at every load; a
bad one is deleted and rebuilt, never served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from radixserve.file_hash import file_sha256, modules_digest

from .cache_dir import CACHE_DIR_ENV, default_cache_dir  # noqa: F401 (re-exported)
from .checked_safetensors import DTYPE_NAMES, BadFile, read_checked, write_checked

log = logging.getLogger(__name__)

# Modules whose code decides what a GGUF's parameters hold: editing one retires old entries.
_FINGERPRINTED = ("radixserve.model.gguf_loader", "radixserve.model.gguf_file",
                  "radixserve.model.llama", "radixserve.model.weights", "gguf.quants",
                  "radixserve.model.quantized_linear", "radixserve.model.weights_dtype")


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    return modules_digest(_FINGERPRINTED, torch.__version__.encode())


@dataclass(frozen=True)
class WeightsCache:
    directory: Path

    @classmethod
    def at(cls, directory: str | Path | None = None) -> "WeightsCache":
        """The cache in `directory`, or in `default_cache_dir()` when None."""
        return cls(Path(directory).expanduser() if directory else default_cache_dir())

    def entry(self, source: Path, dtype: torch.dtype,
              weights_dtype: str = "bf16") -> "CacheEntry | None":
        """The entry for `source` (a GGUF) loaded in `dtype`, its linears in `weights_dtype`
        (int8/int4: the packed form is stored); None for dtypes not cached."""
        if dtype not in DTYPE_NAMES:
            return None
        form = "" if weights_dtype == "bf16" else f"{weights_dtype}-"   # before the dtype:
        # a family must not be a prefix of another form's (superseded entries are globbed)
        family = f"{source.stem}-{file_sha256(source)}-{form}{DTYPE_NAMES[dtype]}-"
        key = family.removeprefix(f"{source.stem}-") + code_fingerprint()
        return CacheEntry(self.directory / f"{family}{code_fingerprint()}.safetensors", key,
                          family)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    key: str
    family: str        # file-name prefix shared by this GGUF's entries in this dtype

    def restore(self, model: nn.Module) -> bool:
        """Give `model` the entry's parameters (on CPU: views of its mapping, no copy).
        False when there is no usable entry; a bad one is deleted (and logged)."""
        expected = model_tensors(model)
        dtypes = {t.dtype for t in expected.values()}
        raw = len(dtypes) > 1            # quantized: every tensor stored as its bytes
        try:
            tensors = read_checked(self.path, self.key, _stored_shapes(expected),
                                   torch.uint8 if raw else dtypes.pop())
        except FileNotFoundError:
            return False
        except OSError as e:                      # unreadable: rebuilding may still work
            log.warning("weights cache: cannot read %s: %s", self.path, e)
            return False
        except BadFile as e:
            log.warning("weights cache: discarding %s: %s", self.path, e)
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        if raw:
            tensors = {n: tensors[n].view(t.dtype).view(t.shape) for n, t in expected.items()}
        assign_parameters(model, tensors)
        return True

    def save(self, model: nn.Module) -> bool:
        """Write `model`'s parameters as this entry; False (logged) where that fails."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tensors = model_tensors(model)
            if len({t.dtype for t in tensors.values()}) > 1:
                tensors = {n: _as_bytes(t) for n, t in tensors.items()}
            write_checked(self.path, self.key, tensors)
        except OSError as e:
            log.warning("weights cache: cannot write %s (%s); the GGUF will be dequantized "
                        "at every start", self.path, e)
            return False
        self._remove_superseded()
        return True

    def _remove_superseded(self) -> None:
        """Delete this GGUF's entries in this dtype written by other loading code: no
        start of this code can use them (processes mapping one keep their pages)."""
        for old in self.path.parent.glob(f"{self.family}*.safetensors"):
            if old != self.path:
                try:
                    old.unlink()
                except OSError as e:
                    log.warning("weights cache: cannot remove %s: %s", old, e)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers (a quantized layer's packed weights), each shared
    one once, under the name `named_parameters()` / `named_buffers()` give it. Buffers
    not persistent (rotary tables, derived at construction) are left out."""
    return {**dict(model.named_parameters()), **dict(_persistent_buffers(model))}


def _persistent_buffers(model: nn.Module, remove_duplicate: bool = True):
    for name, buf in model.named_buffers(remove_duplicate=remove_duplicate):
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buf


def _stored_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    if len({t.dtype for t in tensors.values()}) == 1:
        return {n: tuple(t.shape) for n, t in tensors.items()}
    return {n: (t.numel() * t.element_size(),) for n, t in tensors.items()}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assign_parameters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace `model`'s parameters and buffers by `tensors` (keyed as `model_tensors`
    names them), keeping shared ones (tied embeddings) shared. On another device than
    the CPU the tensors are copied there."""
    owners: dict[int, list[str]] = {}
    old: dict[int, torch.Tensor] = {}
    for name, p in [*model.named_parameters(remove_duplicate=False),
                    *_persistent_buffers(model, remove_duplicate=False)]:
        owners.setdefault(id(p), []).append(name)
        old[id(p)] = p
    for pid, names in owners.items():
        data = tensors[names[0]]              # the name named_parameters() reports
        if data.device != old[pid].device:
            data = data.to(old[pid].device)
        new = (nn.Parameter(data, requires_grad=old[pid].requires_grad)
               if isinstance(old[pid], nn.Parameter) else data)
        for name in names:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, new)
