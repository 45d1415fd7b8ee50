"""WeightsCache: a GGUF's dequantized weights kept on disk, so they are dequantized once.

Dequantizing SmolLM2's Q4_1 file takes ~1.8 s at every start on 2 cores; checking and
mapping the cached result takes ~0.2 s. An entry is keyed by the GGUF's content hash
(sha256), the working dtype and FORMAT_VERSION, so a changed file (or a change to how we
dequantize) never matches an old entry. An entry is written to a temporary file and
renamed into place, so no reader sees it half-written; it carries a crc32 of its data,
checked at every load, and a corrupt or truncated entry is deleted and rebuilt, never
served. Readers map the file (copy-on-write): no second copy is read into memory.

Entries are safetensors files (inspectable with its tools) whose metadata holds
`format`, `key` and `crc32`. They are written tensor by tensor, so building one holds one
dequantized tensor at a time, never a second copy of the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

import torch

from .weights import LazyWeights

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "RADIXSERVE_CACHE_DIR"
FORMAT = "radixserve-dequantized-weights"
FORMAT_VERSION = 1        # bump whenever what a GGUF dequantizes to changes
_ALIGN = 64               # data starts on this boundary, as safetensors pads its header
_CRC_PLACEHOLDER = "00000000"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_TORCH_DTYPES = {name: dt for dt, name in _DTYPES.items()}

Outcome = Literal["hit", "stored", "not stored"]


def default_cache_dir() -> Path:
    """$RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "radixserve"


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)              # releases the GIL: other threads run
    return digest.hexdigest()


class BadEntry(Exception):
    """A cache entry that must not be served (the message says why)."""


@dataclass(frozen=True)
class WeightsCache:
    directory: Path

    @classmethod
    def at(cls, directory: str | Path | None = None) -> "WeightsCache":
        return cls(Path(directory).expanduser() if directory else default_cache_dir())

    def key(self, source: Path, dtype: torch.dtype) -> str:
        return f"{file_sha256(source)}-{_DTYPES[dtype]}-v{FORMAT_VERSION}"

    def path_for(self, source: Path, key: str) -> Path:
        return self.directory / f"{source.stem}-{key}.safetensors"

    def weights_for(self, source: Path, dtype: torch.dtype,
                    weights: LazyWeights) -> tuple[Mapping[str, torch.Tensor], Outcome]:
        """The cached weights of `source` (a GGUF) in `dtype`; on a miss, `weights` (the
        dequantizing reader) is written to the cache first. Where the cache cannot be
        written, `weights` itself is returned: slower, never wrong."""
        if dtype not in _DTYPES:
            return weights, "not stored"
        key = self.key(source, dtype)
        entry = self.path_for(source, key)
        cached = self._load_or_discard(entry, key, weights.shapes, dtype)
        if cached is not None:
            return cached, "hit"
        try:
            self.store(entry, key, weights, dtype)
        except OSError as e:
            log.warning("weights cache: cannot write %s (%s); dequantizing at every start",
                        entry, e)
            return weights, "not stored"
        cached = self._load_or_discard(entry, key, weights.shapes, dtype)
        return (cached, "stored") if cached is not None else (weights, "not stored")

    def _load_or_discard(self, entry: Path, key: str, shapes: Mapping[str, tuple[int, ...]],
                         dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        try:
            return load_entry(entry, key, shapes, dtype)
        except FileNotFoundError:
            return None
        except OSError as e:                      # unreadable: rebuilding may still work
            log.warning("weights cache: cannot read %s: %s", entry, e)
            return None
        except BadEntry as e:
            log.warning("weights cache: discarding %s: %s", entry, e)
            try:
                entry.unlink(missing_ok=True)
            except OSError:
                pass
            return None

    def store(self, entry: Path, key: str, weights: Mapping[str, torch.Tensor],
              dtype: torch.dtype) -> None:
        """Write `weights` tensor by tensor into a temporary file, then rename it to `entry`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        names = list(weights)
        shapes = {n: tuple(weights.shapes[n]) if isinstance(weights, LazyWeights)
                  else tuple(weights[n].shape) for n in names}
        header, crc_at = _header(key, names, shapes, dtype)
        fd, tmp = tempfile.mkstemp(prefix=entry.name + ".", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                crc = 0
                for name in names:
                    data = _tensor_bytes(weights[name], dtype, shapes[name], name)
                    crc = zlib.crc32(data, crc)
                    f.write(data)
                f.seek(crc_at)
                f.write(f"{crc:08x}".encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, entry)
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
        meta[name] = {"dtype": _DTYPES[dtype], "shape": list(shapes[name]),
                      "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    marker = f'"crc32":"{_CRC_PLACEHOLDER}"'.encode()
    crc_at = 8 + text.index(marker) + len(marker) - 1 - len(_CRC_PLACEHOLDER)
    return struct.pack("<Q", len(text)) + text, crc_at


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                  name: str) -> memoryview:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"weights cache: {name} is {t.dtype} {tuple(t.shape)}, "
                         f"expected {dtype} {shape}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def load_entry(entry: Path, key: str, shapes: Mapping[str, tuple[int, ...]],
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors backed by a copy-on-write mapping of `entry`, after checking that it is
    complete, is for `key`, holds exactly `shapes` in `dtype`, and matches its crc32.
    FileNotFoundError when absent; BadEntry when it must not be served."""
    with open(entry, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise BadEntry(f"{size} bytes: truncated")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise BadEntry("header runs past the end of the file: truncated")
        try:
            header = json.loads(f.read(header_len))
            meta = header.pop("__metadata__")
            crc = int(meta["crc32"], 16)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadEntry(f"unreadable header ({e})") from None
        if meta.get("format") != FORMAT or meta.get("key") != key:
            raise BadEntry(f"made for another key or format ({meta.get('key')!r})")
        data_start = 8 + header_len
        try:
            layout = _check_layout(header, shapes, dtype, size - data_start)
        except (KeyError, TypeError, ValueError) as e:
            raise BadEntry(f"unreadable tensor entry ({e!r})") from None
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if zlib.crc32(memoryview(mapping)[data_start:]) != crc:
        raise BadEntry("crc32 of the data does not match: corrupted")
    return {name: torch.frombuffer(mapping, dtype=dtype, count=_numel(shape),
                                   offset=data_start + begin).view(shape)
            for name, (begin, shape) in layout.items()}


def _check_layout(header: dict, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                  data_size: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (data offset, shape), once the entry's tensors tile its data exactly."""
    if set(header) != set(shapes):
        raise BadEntry(f"holds other tensors than the model's "
                       f"({sorted(set(header) ^ set(shapes))[:3]})")
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout, end = {}, 0
    for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = spec["data_offsets"]
        shape = tuple(spec["shape"])
        if (_TORCH_DTYPES.get(spec["dtype"]) != dtype or shape != tuple(shapes[name])
                or begin != end or stop - begin != itemsize * _numel(shape)):
            raise BadEntry(f"tensor {name} does not match the model or the file layout")
        layout[name], end = (begin, shape), stop
    if end != data_size:
        raise BadEntry(f"data is {data_size} bytes, the header says {end}: truncated")
    return layout
