"""Read a GGUF file's header: metadata key/values and tensor descriptions, no tensor data.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every field, and a
tokenizer's 49k tokens and 49k merges are ~400k parts: 2.5 s for SmolLM2's header, against
~0.1 s here. The format (llama.cpp's docs/gguf.md) is small: magic, version, counts, then
key/values, then one (name, dims, type, offset) per tensor, then the aligned data. Tensor
data is reached through `tensor_bytes`, a view of the file mapping, read only when asked.
This module does not import torch, so a tokenizer can be built without it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (little-endian); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]     # ggml order: fastest-varying first (reverse of numpy/torch)
    type: int                 # a gguf.GGMLQuantizationType value
    offset: int               # of its data, from the start of the file
    num_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]                # strings decoded; arrays as lists
    tensors: dict[str, GGUFTensorInfo]      # file order
    file_size: int

    def check_complete(self) -> None:
        """ModelLoadError unless every tensor's data lies inside the file (a truncated
        download fails here, with a sentence; a tokenizer needs no data and skips this)."""
        for info in self.tensors.values():
            if info.offset + info.num_bytes > self.file_size:
                raise ModelLoadError(
                    f"{self.path} is not a readable GGUF file: tensor {info.name} ends past "
                    f"the end of the file ({self.file_size} bytes): truncated?")


class _Cursor:
    """Sequential little-endian reads over a buffer, with a sentence on truncation."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: truncated header")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: truncated header")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.raw_string().decode("utf-8")
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ModelLoadError(f"{self.path} is not a readable GGUF file: "
                                         f"truncated header")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos = end
                return arr.tolist()
            if etype == _STRING:
                return [self.raw_string().decode("utf-8") for _ in range(count)]
            return [self.value(etype) for _ in range(count)]
        raise ModelLoadError(f"{self.path} is not a readable GGUF file: "
                             f"unknown value type {vtype}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor descriptions; ModelLoadError if the file is not a GGUF we read."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:                               # empty file
            raise ModelLoadError(f"{path} is not a readable GGUF file: empty") from None
    with buf:
        return _parse(buf, path)


def _parse(buf, path: Path) -> GGUFHeader:
    cur = _Cursor(buf, path)
    if len(buf) < 24 or buf[:4] != MAGIC:
        raise ModelLoadError(f"{path} is not a readable GGUF file: no GGUF magic")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path} is not a readable GGUF file: version {version} "
                             f"(big-endian files and versions other than 2, 3 are not read)")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.raw_string().decode("utf-8")
        try:
            metadata[key] = cur.value(cur.unpack("<I"))
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{path}: metadata {key!r} is not valid UTF-8 ({e})") from None
    infos = []
    for _ in range(num_tensors):
        name = cur.raw_string().decode("utf-8")
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment {alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {name: GGUFTensorInfo(name, dims, ttype, data_start + offset,
                                    _num_bytes(dims, ttype))
               for name, dims, ttype, offset in infos}
    return GGUFHeader(path, metadata, tensors, len(buf))


def _num_bytes(dims: tuple[int, ...], ttype: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise ModelLoadError(f"unknown GGML tensor type {ttype}") from None
    return int(np.prod(dims, dtype=np.int64)) * type_size // block_size


def tensor_array(file: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's stored data as `gguf.quants.dequantize` takes it: typed for float
    types, rows of bytes (…, bytes per row) for quantized ones. A view of `file`."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quant_shape_to_byte_shape

    raw = file[info.offset:info.offset + info.num_bytes]
    typed = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64}.get(T(info.type))
    if typed is not None:
        return raw.view(typed).reshape(info.shape)
    return raw.reshape(quant_shape_to_byte_shape(info.shape, T(info.type)))
