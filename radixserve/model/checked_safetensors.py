"""Safetensors files that carry a crc32 of their data, written atomically, read by mapping.

`write_checked` streams tensors one at a time into a temporary file next to the target and
renames it into place, so no reader ever sees a half-written file (and a crash leaves only
a stray `*.tmp`). `read_checked` refuses (`BadFile`) anything truncated, for another key,
with another layout than expected, or whose data does not match the crc32; what it returns
are views of a copy-on-write mapping of the file, so nothing is read twice into memory.
The files stay plain safetensors, readable by its tools; metadata: `format`, `key`, `crc32`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Mapping

import torch

FORMAT = "radixserve-checked-weights"
_ALIGN = 64               # data starts on this boundary (safetensors pads its header so)
_CRC_PLACEHOLDER = "00000000"
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_TORCH_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}
_TORCH_DTYPES["U8"] = torch.uint8     # raw bytes: tensors of several dtypes in one file
_FILE_DTYPE_NAMES = {**DTYPE_NAMES, torch.uint8: "U8"}


class BadFile(Exception):
    """A file that must not be used (the message says why)."""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def write_checked(path: Path, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write `tensors` (one dtype) to a temporary file, then rename it to `path`."""
    names = list(tensors)
    dtype = tensors[names[0]].dtype
    shapes = {n: tuple(tensors[n].shape) for n in names}
    header, crc_at = _header(key, names, shapes, dtype)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            crc = 0
            for name in names:
                data = _tensor_bytes(tensors[name], dtype, name)
                crc = zlib.crc32(data, crc)
                f.write(data)
            f.seek(crc_at)
            f.write(f"{crc:08x}".encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _header(key: str, names: list[str], shapes: dict[str, tuple[int, ...]],
            dtype: torch.dtype) -> tuple[bytes, int]:
    """The safetensors header (length prefix included) and where the crc32 digits sit."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    meta = {"__metadata__": {"format": FORMAT, "key": key, "crc32": _CRC_PLACEHOLDER}}
    offset = 0
    for name in names:
        size = itemsize * _numel(shapes[name])
        meta[name] = {"dtype": _FILE_DTYPE_NAMES[dtype], "shape": list(shapes[name]),
                      "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    marker = f'"crc32":"{_CRC_PLACEHOLDER}"'.encode()
    crc_at = 8 + text.index(marker) + len(marker) - 1 - len(_CRC_PLACEHOLDER)
    return struct.pack("<Q", len(text)) + text, crc_at


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype, name: str) -> memoryview:
    if t.dtype != dtype:
        raise ValueError(f"{name} is {t.dtype}; every tensor of a file must be {dtype}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def read_checked(path: Path, key: str, shapes: Mapping[str, tuple[int, ...]],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of `path` as views of its copy-on-write mapping, once it is checked to be
    complete, written for `key`, holding exactly `shapes` in `dtype`, and matching its
    crc32. FileNotFoundError when absent; BadFile when it must not be used."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise BadFile(f"{size} bytes: truncated")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise BadFile("header runs past the end of the file: truncated")
        try:
            header = json.loads(f.read(header_len))
            meta = header.pop("__metadata__")
            crc = int(meta["crc32"], 16)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadFile(f"unreadable header ({e!r})") from None
        if meta.get("format") != FORMAT or meta.get("key") != key:
            raise BadFile(f"written for another key or format ({meta.get('key')!r})")
        data_start = 8 + header_len
        try:
            layout = _check_layout(header, shapes, dtype, size - data_start)
        except (KeyError, TypeError, ValueError) as e:
            raise BadFile(f"unreadable tensor entry ({e!r})") from None
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if zlib.crc32(memoryview(mapping)[data_start:]) != crc:
        raise BadFile("crc32 of the data does not match: corrupted")
    return {name: torch.frombuffer(mapping, dtype=dtype, count=_numel(shape),
                                   offset=data_start + begin).view(shape)
            for name, (begin, shape) in layout.items()}


def _check_layout(header: dict, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                  data_size: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (data offset, shape), once the file's tensors tile its data exactly."""
    if set(header) != set(shapes):
        raise BadFile(f"holds other tensors than expected "
                      f"(e.g. {sorted(set(header) ^ set(shapes))[:3]})")
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout, end = {}, 0
    for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = spec["data_offsets"]
        shape = tuple(spec["shape"])
        if (_TORCH_DTYPES.get(spec["dtype"]) != dtype or shape != tuple(shapes[name])
                or begin != end or stop - begin != itemsize * _numel(shape)):
            raise BadFile(f"tensor {name} does not match the expected shape, dtype or layout")
        layout[name], end = (begin, shape), stop
    if end != data_size:
        raise BadFile(f"data is {data_size} bytes, the header says {end}: truncated")
    return layout
