"""ModelFingerprint: what must be equal for KV pages on disk to be valid for this server.

A page holds the K/V that one model, in one dtype and KV layout, computed for some tokens.
Served to any other configuration it would be silently wrong, so the disk store records the
fingerprint of the server that wrote it and refuses (leaving the directory untouched) a
directory written by another: other weights, dtype, page size, KV storage format, shape, or
other code computing K/V.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

import msgspec

from radixserve.file_hash import file_sha256

__all__ = ["ModelFingerprint", "model_fingerprint", "weights_sha256", "kv_code_hash"]

# Modules whose code decides which K/V a token gets: editing one retires pages on disk.
_KV_CODE_MODULES = ("radixserve.model.llama", "radixserve.model.rope",
                    "radixserve.model.weights", "radixserve.model.gguf_loader",
                    "radixserve.model.hf_loader", "radixserve.attention.kv_quant",
                    "radixserve.attention.kv_pool")


class ModelFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    weights_sha256: str     # the GGUF's sha256 (an HF directory: its config and weight files)
    dtype: str              # the model's working dtype ("float32", "bfloat16", ...)
    page_size: int          # tokens per page
    kv_layout: str          # storage order and K/V formats, e.g. "NHD k=float32 v=float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    code: str = ""          # hash of the K/V-computing code and torch's version

    def describe_mismatch(self, other: "ModelFingerprint") -> str | None:
        """None when equal; else one line naming every difference, `self` being what the
        directory holds and `other` this server."""
        if self == other:
            return None
        diffs = []
        for name in self.__struct_fields__:
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                if name in ("weights_sha256", "code"):
                    ours, theirs = str(ours)[:12], str(theirs)[:12]
                diffs.append(f"{name.replace('_', ' ')} {ours} there, {theirs} here")
        return "; ".join(diffs)


def weights_sha256(model_path: Path) -> str:
    """The GGUF file's sha256 (memoized: the weights cache hashes the same file), or for a
    Hugging Face directory the sha256 of its config and weight files' hashes."""
    path = Path(model_path)
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".bin")):
            digest.update(f"{f.name}\0{file_sha256(f)}\0".encode())
    return digest.hexdigest()


def kv_code_hash() -> str:
    """sha256 (16 hex digits) of the K/V-computing modules' source and torch's version,
    read without importing them (this package never imports torch)."""
    digest = hashlib.sha256()
    try:
        digest.update(importlib.metadata.version("torch").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    for name in _KV_CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def model_fingerprint(*, model_path: Path, dtype: str, page_size: int, kv_k: str, kv_v: str,
                      num_layers: int, num_kv_heads: int, head_dim: int,
                      fixed_kv_scale: float | None = None) -> ModelFingerprint:
    """The fingerprint of a running engine, from what its runner knows: the model file
    (`registry.resolve_model_path`), the working dtype, the page size, the KV pool's K and V
    formats (and the fixed scale of 8-bit codes, when the backend uses one) and its shape."""
    layout = f"NHD k={kv_k} v={kv_v}"
    if fixed_kv_scale is not None:
        layout += f" scale={fixed_kv_scale!r}"
    return ModelFingerprint(weights_sha256=weights_sha256(model_path),
                            dtype=str(dtype).removeprefix("torch."), page_size=page_size,
                            kv_layout=layout, num_layers=num_layers,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, code=kv_code_hash())
