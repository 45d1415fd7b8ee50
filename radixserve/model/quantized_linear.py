"""Weight-only quantized linear layers on torch's CPU kernels: int8 per output channel, int4
in groups of 32 along the input; activations stay in the model's dtype (bf16).

Why these kernels: a decode step streams every weight once, so its cost is the weights'
bytes. ``_weight_int8pack_mm`` reads 1 byte per weight, ``_weight_int4pack_mm_for_cpu``
0.5 byte plus a (scale, zero) pair per group, against 2 for bf16. Both are row-invariant
(a row's result does not depend on the other rows: checked for 1..1,024 rows), so
deterministic mode uses them as they are.

Conventions (checked against the kernels):
- int8: ``w = q * scale[n]``, q in [-127, 127], one scale per output row (the kernel has
  no per-group form, so GGUF's Q8_0 per-32 scales are re-quantized per row: not exact).
- int4: ``w = (q - 8) * scale + zero`` per (row, group of 32), q in [0, 15]. GGUF's
  Q4_1 (``w = d * q + m``) maps to scale = d, zero = m + 8d and Q4_0 (``d * (q - 8)``) to
  scale = d, zero = 0: the same integers, scales rounded from fp16 to the activations'
  dtype (bf16: 8 significant bits instead of 11). Other formats are dequantized to fp32
  and re-quantized with each group's min and max.
- Activations: the kernels run in bf16 (or fp16). A float32 model (a CPU without native
  bf16, where ``--dtype auto`` picks float32) casts each linear's input to bf16 and its
  output back: the cast of one [T, in] row block is cheap, while the kernels' own fp32
  paths measured 5-10x slower than their bf16 ones at SmolLM2's shapes (CPU time, 1
  thread), slower than fp32 ``F.linear`` itself.
- The kernels need: int4, out_features a multiple of 16 and in_features of 32; int8,
  in_features a multiple of 32 (other widths crash or give inf). Other shapes are refused
  at load (``QuantizationError`` naming the layer), never served in another dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ModelLoadError

__all__ = ["GROUP_SIZE", "Int4Groups", "Int4Linear", "Int8Linear", "Int8Embedding",
           "QuantizationError", "can_pack", "int4_groups_from_float", "int8_from_float",
           "kernel_dtype"]

GROUP_SIZE = 32          # GGUF's block size; the int4 kernel takes 32, 64, 128 or 256
_INT4_ROWS = 16          # _convert_weight_to_int4pack_for_cpu packs rows in 16s
_INT8_COLS = 32          # _weight_int8pack_mm reads the input in 32-wide tiles


class QuantizationError(ModelLoadError):
    """A layer whose shape the weight-only kernels cannot take."""


@dataclass
class Int4Groups:
    """An int4 weight before packing: ``w = q * scale + offset`` per (row, group), where
    q is uint8 in [0, 15], scale and offset float32 [rows, cols / GROUP_SIZE]. This is
    GGUF's own Q4_1 form, so GGUF blocks convert without rounding."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.q.float().unflatten(1, (-1, GROUP_SIZE))
        return (g * self.scale[..., None] + self.offset[..., None]).flatten(1)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        """Row-wise concatenation (fused q/k/v, gate/up)."""
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("q", "scale", "offset")))


def int4_groups_from_float(w: torch.Tensor) -> Int4Groups:
    """Asymmetric per-group quantization from each group's min and max (round to nearest)."""
    g = w.float().unflatten(1, (-1, GROUP_SIZE))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return Int4Groups(q.flatten(1).to(torch.uint8), scale, lo)


def int8_from_float(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: (q int8 [rows, cols], scale float32 [rows])."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def _tiles(kind: str) -> tuple[int, int]:
    return (_INT4_ROWS, GROUP_SIZE) if kind == "int4" else (1, _INT8_COLS)


def can_pack(kind: str, out_features: int, in_features: int) -> bool:
    """Whether the ``kind`` kernel takes an [out, in] weight."""
    rows, cols = _tiles(kind)
    return out_features % rows == 0 and in_features % cols == 0


def check_shape(name: str, kind: str, out_features: int, in_features: int) -> None:
    """QuantizationError unless the ``kind`` kernel takes an [out, in] weight."""
    rows, cols = _tiles(kind)
    if not can_pack(kind, out_features, in_features):
        raise QuantizationError(
            f"--weights-dtype {kind}: layer {name} ({out_features}x{in_features}) cannot be "
            f"packed: the {kind} kernel needs out_features a multiple of {rows} and "
            f"in_features a multiple of {cols}; use --weights-dtype bf16")


def kernel_dtype(activations: torch.dtype) -> torch.dtype:
    """The dtype the weight-only kernels compute in for a model of ``activations``."""
    return torch.bfloat16 if activations == torch.float32 else activations


def _flat_call(x: torch.Tensor, fn, bias: torch.Tensor | None,
               kernel: torch.dtype) -> torch.Tensor:
    y = fn(x.reshape(-1, x.shape[-1]).to(kernel).contiguous()).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def _plain_rows(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A contiguous [T, in] input and no bias: the kernels take it as it is (the model's
    every linear; the short path saves ~10 us a call, four calls per layer per step)."""
    return bias is None and x.dim() == 2 and x.is_contiguous()


class Int4Linear(nn.Module):
    """A linear layer of packed int4 weights (``_weight_int4pack_mm_for_cpu``)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 bias: bool = False, name: str = "linear") -> None:
        super().__init__()
        check_shape(name, "int4", out_features, in_features)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", torch.empty(out_features, in_features // 2,
                                                   dtype=torch.uint8))
        self.register_buffer("scale_zeros", torch.empty(in_features // GROUP_SIZE,
                                                        out_features, 2,
                                                        dtype=kernel_dtype(dtype)))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    @torch.no_grad()
    def load(self, groups: Int4Groups) -> None:
        """Pack ``groups``: our ``q * scale + offset`` is the kernel's
        ``(q - 8) * scale + zero`` with zero = offset + 8 * scale."""
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            groups.q.to(torch.int32).contiguous(), 2)
        zero = groups.offset + 8 * groups.scale
        sz = torch.stack([groups.scale, zero], dim=-1).transpose(0, 1)
        self.scale_zeros = sz.to(self.scale_zeros.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scale_zeros
        if _plain_rows(x, self.bias):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(sz.dtype), self.packed, GROUP_SIZE, sz).to(x.dtype)
        return _flat_call(x, lambda a: torch.ops.aten._weight_int4pack_mm_for_cpu(
            a, self.packed, GROUP_SIZE, sz), self.bias, sz.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group=32"


class Int8Linear(nn.Module):
    """A linear layer of int8 weights with a scale per output row (``_weight_int8pack_mm``)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 bias: bool = False, name: str = "linear") -> None:
        super().__init__()
        check_shape(name, "int8", out_features, in_features)
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = dtype              # the activations' (the kernel's: kernel_dtype)
        self.register_buffer("q", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, dtype=kernel_dtype(dtype)))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    @torch.no_grad()
    def load(self, weight: torch.Tensor) -> None:
        q, scale = int8_from_float(weight)
        self.q, self.scale = q.contiguous(), scale.to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _plain_rows(x, self.bias):
            return torch.ops.aten._weight_int8pack_mm(
                x.to(self.scale.dtype), self.q, self.scale).to(x.dtype)
        return _flat_call(x, lambda a: torch.ops.aten._weight_int8pack_mm(
            a, self.q, self.scale), self.bias, self.scale.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Embedding(nn.Module):
    """Token embeddings read from an Int8Linear's rows (``table``; for tied embeddings the
    very LM head module, so the table is stored once)."""

    def __init__(self, table: Int8Linear) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t, dt = self.table, self.table.out_dtype
        return F.embedding(ids, t.q).to(dt) * F.embedding(ids, t.scale[:, None]).to(dt)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (for code that reads an embedding's dtype or shape)."""
        t = self.table
        return t.q.to(t.out_dtype) * t.scale[:, None].to(t.out_dtype)
