"""8-bit KV storage: encode K or V into fp8/int8 codes with scales, and decode them back.

Granularity: one float32 scale per token per KV head (amax over head_dim / the format's
largest code), written in the same step as the token's codes and never touched again.
That is finer than the per-page-per-head scale the issue asks for, and it makes the
"a full page's scale never changes" rule hold by construction: no later write, chunk
boundary or reader can alter a written slot. A per-page scale fixed at the page's first
write would have to clamp tokens arriving later in larger magnitude; and worse, the bytes
of a token would depend on how the page was filled (cache on vs off, chunk sizes), so
a prefix computed once and a prefix read from the tree could differ. Per-token scales
cost 4 bytes per head per token (6% of a 64-wide fp8 head), counted in the pool's size.

The flashinfer path takes one scalar scale per tensor (``run(..., k_scale=, v_scale=)``),
so there the codec runs with a fixed scale of 1.0 (as vLLM's and SGLang's uncalibrated
FP8 KV does): codes are K/V themselves in fp8 and the scale tensor holds 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.kv_sizing import KVFormat, kv_element

_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "int8": torch.int8}
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCALE_DTYPE = torch.float32
# fp8 format -> (mantissa bits, exponent bias); float dtype -> (same-width int, mantissa
# bits, exponent bias)
_FP8_BITS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
_FLOAT_BITS = {torch.bfloat16: (torch.int16, 7, 127), torch.float16: (torch.int16, 10, 15),
               torch.float32: (torch.int32, 23, 127)}


def _fp8_magnitude_bits(codes: torch.Tensor, storage: torch.dtype, out: torch.Tensor) -> float:
    """Write fp8 codes into ``out`` (a float tensor) by moving their bits: the code's
    exponent and mantissa bits go under the float's mantissa top, the sign to its sign bit.
    That is the code's value times 2^(bias_float - bias_fp8) exactly, subnormals included
    (the float's exponent field then holds the code's, unbiased differently); returns the
    power of two to multiply by. Integer ops only: ~50x faster than torch's CPU fp8 cast."""
    mant8, bias8 = _FP8_BITS[storage]
    itype, mant, bias = _FLOAT_BITS[out.dtype]
    shift = mant - mant8
    # int8 -> int: sign-extends, so after the shift the sign bit is set for negative codes,
    # as are the bits between it and the code's exponent, which the mask clears.
    mask = -(1 << (torch.iinfo(itype).bits - 1)) | (0x7F << shift)
    ints = out.view(itype)
    ints.copy_(codes.view(torch.int8))
    ints.bitwise_left_shift_(shift).bitwise_and_(mask)
    return 2.0 ** (bias - bias8)


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype K or V is stored in for a KV dtype name (kv_sizing's names)."""
    name = kv_element(name).name
    return _STORAGE.get(name) or _FLOATS[name]


@dataclass(frozen=True)
class KVCodec:
    """How one side (K or V) is stored; quantized formats carry a scale per token and head."""
    name: str
    storage: torch.dtype
    fixed_scale: float | None = None     # flashinfer: one scalar scale for the whole tensor

    @classmethod
    def of(cls, name: str, fixed_scale: float | None = None) -> "KVCodec":
        return cls(kv_element(name).name, storage_dtype(name), fixed_scale)

    @property
    def quantized(self) -> bool:
        return self.name in _STORAGE

    @property
    def max_code(self) -> float:
        if self.storage == torch.int8:
            return 127.0
        return float(torch.finfo(self.storage).max)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (codes [..., D] in storage dtype, scales [...] float32)."""
        xf = x.float()
        if self.fixed_scale is not None:
            scale = torch.full(xf.shape[:-1], self.fixed_scale, dtype=SCALE_DTYPE,
                               device=x.device)
        else:
            amax = xf.abs().amax(dim=-1)
            # An all-zero head gets scale 1 (any positive value decodes zeros exactly).
            scale = torch.where(amax > 0, amax / self.max_code, torch.ones_like(amax))
        y = (xf / scale.unsqueeze(-1)).clamp_(-self.max_code, self.max_code)
        if self.storage == torch.int8:
            y = y.round_()
        elif self.fixed_scale is None:
            # No subnormal codes: gather_folded hands codes to the GEMMs unscaled, where a
            # subnormal code would be a denormal float, which CPU kernels may treat as 0.
            # With the head's amax at the top code this drops |x| < amax * 3.5e-5 (e4m3).
            y.masked_fill_(y.abs() < torch.finfo(self.storage).smallest_normal, 0.0)
        return y.to(self.storage), scale

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """codes [..., D], scales [...] -> values [..., D] in `dtype` (into `out` if given).

        The one decoding rule: the gather and the new tokens of a step both use it, so a
        token reads the same values whether it was computed now or read back from a page.
        """
        if out is None:
            out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        scales = scales.to(SCALE_DTYPE) * self.magnitudes(codes, out)
        return out.mul_(scales.to(dtype).unsqueeze(-1))

    def magnitudes(self, codes: torch.Tensor, out: torch.Tensor) -> float:
        """Write the codes, unscaled, into ``out`` (a float tensor of their shape) and return
        the power of two ``p`` with code value = out * p, exactly (fp8 codes move by bits on
        CPU and come out as value / p; int8 codes and GPU casts give p = 1)."""
        if self.storage in _FP8_BITS and out.dtype in _FLOAT_BITS \
                and codes.device.type == "cpu":
            # torch's CPU fp8 -> float casts run ~16 ns an element (int8: 0.1 ns), which
            # would make decode with FP8 KV several times slower than with bf16 KV.
            return _fp8_magnitude_bits(codes, self.storage, out)
        out.copy_(codes)
        return 1.0

    def round_trip(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes, scales = self.encode(x)
        return self.decode(codes, scales, dtype)

    def error_bound(self, amax: torch.Tensor) -> torch.Tensor:
        """Largest |decode(encode(x)) - x| for a head whose |x| peaks at `amax` (before
        the final cast to the compute dtype): half a code step at the top of the range,
        plus float32 rounding of the scale arithmetic."""
        fp32_slack = amax * 2.0 ** -20
        if self.storage == torch.int8:
            return amax / self.max_code * 0.5 + fp32_slack
        mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[self.storage]
        scale = amax / self.max_code if self.fixed_scale is None else self.fixed_scale
        # relative rounding error 2^-(m+1) of the largest magnitude; below the smallest
        # normal code, values round to subnormals (fixed scale) or flush to zero (per-token
        # scales, see encode): at most that smallest normal
        tiny = torch.finfo(self.storage).smallest_normal
        return amax * 2.0 ** -(mantissa_bits + 1) + scale * tiny + fp32_slack


def gather_decoded(codec: KVCodec, flat: torch.Tensor, scales_flat: torch.Tensor | None,
                   rows: torch.Tensor, dtype: torch.dtype, ws, name: str) -> torch.Tensor:
    """Rows (one head of one token each, index ``slot * Hkv + head``) of one side of a
    layer, decoded to ``dtype``: [len(rows), D], a workspace tensor under ``name``."""
    if not codec.quantized:
        words = _as_words(flat)
        out = ws.take(name, (rows.shape[0], words.shape[1]), words.dtype, flat.device)
        return torch.index_select(words, 0, rows, out=out).view(flat.dtype)
    codes, scales = _gather_codes(flat, scales_flat, rows, ws, name)
    out = ws.take(name, codes.shape, dtype, flat.device)
    return codec.decode(codes.view(codec.storage), scales, dtype, out=out)


def _as_words(flat: torch.Tensor) -> torch.Tensor:
    """[..., D] -> the same bytes as rows of int64 words where the row allows:
    index_select's int64 path is ~1.5x faster on CPU than its bf16 or uint8 ones."""
    rows = flat.view(-1, flat.shape[-1])
    return rows.view(torch.int64) if rows.shape[1] * rows.element_size() % 8 == 0 else rows


@dataclass(frozen=True)
class FoldedRows:
    """Gathered rows of one side with their scales left for the attention to apply.

    Row i decodes to ``values[i] * scales[i] * lift`` (in real arithmetic). Decode attention
    multiplies a key's scale into its score and a value's into its probability, one
    multiply per token instead of one per element. ``lift`` is a power of two kept apart so
    that products stay normal floats: fp8 codes moved by bits are tiny (value * 2^-120 in
    bf16/fp32), so q is multiplied by ``lift`` before q @ K^T, and p @ V's result after.
    Unquantized sides come with ``scales`` None and ``lift`` 1.
    """
    values: torch.Tensor            # [n, D] in the compute dtype
    scales: torch.Tensor | None     # [n] float32
    lift: float = 1.0


def can_fold(dtype: torch.dtype, codecs: Sequence[KVCodec]) -> bool:
    """Whether decode attention in ``dtype`` may read FoldedRows of pages in ``codecs``.

    Only per-token scales fold: flashinfer's one per-tensor scale (CUDA pools, where the
    torch backend is the GPU check's reference and int8's fallback) has nothing per token to
    fold, so those pages decode in the gather. And only in bf16/fp32: unscaled codes reach
    57344 (e5m2) or 2^-111 (e4m3 moved by bits into bf16), which bf16 and fp32 hold with
    room for q . k sums, and fp16 (max 65504, min normal 2^-14) does not."""
    return (dtype in (torch.bfloat16, torch.float32)
            and all(c.fixed_scale is None for c in codecs))


def gather_folded(codec: KVCodec, flat: torch.Tensor, scales_flat: torch.Tensor | None,
                  rows: torch.Tensor, dtype: torch.dtype, ws, name: str) -> FoldedRows:
    """Like gather_decoded, but leaves each row's scale out of the values (FoldedRows)."""
    if not codec.quantized:
        return FoldedRows(gather_decoded(codec, flat, None, rows, dtype, ws, name), None)
    codes, scales = _gather_codes(flat, scales_flat, rows, ws, name)
    out = ws.take(name, codes.shape, dtype, codes.device)
    power = codec.magnitudes(codes.view(codec.storage), out)
    lift = 2.0 ** (int(math.log2(power)) // 2) if power > 2.0 ** 32 else 1.0
    return FoldedRows(out, scales.mul_(power / lift), lift)


def _gather_codes(flat: torch.Tensor, scales_flat: torch.Tensor, rows: torch.Tensor, ws,
                  name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a quantized side: codes [n, D] as uint8 and scales [n] float32 (workspace)."""
    words = _as_words(flat.view(torch.uint8))
    n = rows.shape[0]
    codes = ws.take(f"{name}.codes", (n, words.shape[1]), words.dtype, flat.device)
    torch.index_select(words, 0, rows, out=codes)
    scales = ws.take(f"{name}.scales", (n,), SCALE_DTYPE, flat.device)
    torch.index_select(scales_flat.view(-1), 0, rows, out=scales)
    return codes.view(torch.uint8), scales


def flashinfer_kv_reason(kv_format: KVFormat | None, dtype: torch.dtype) -> str | None:
    """Why flashinfer's paged kernels cannot read this KV storage, or None when they can:
    they take one KV dtype for K and V, the compute dtype or an fp8 one, and no int8."""
    if kv_format is None:
        return None
    if kv_format.k != kv_format.v:
        return f"KV stored as {kv_format.describe()} (flashinfer takes one dtype for K and V)"
    if kv_format.k == "int8":
        return "an int8 KV cache (flashinfer has no int8 KV kernel)"
    if not kv_element(kv_format.k).quantized and storage_dtype(kv_format.k) != dtype:
        return f"a {kv_format.k} KV cache with {dtype} compute"
    return None


def describe_kv_cache(kv_format: KVFormat, compute_dtype: torch.dtype, num_layers: int,
                      num_kv_heads: int, head_dim: int) -> str:
    """The start-up line: the KV dtypes and the capacity gain over storing the compute dtype."""
    base_name = str(compute_dtype).removeprefix("torch.")
    base = KVFormat(base_name, base_name).token_bytes(num_layers, num_kv_heads, head_dim)
    mine = kv_format.token_bytes(num_layers, num_kv_heads, head_dim)
    scales = " (a float32 scale per token and KV head)" if kv_format.quantized else ""
    return (f"KV cache dtype: K {kv_format.k}, V {kv_format.v}{scales}; {mine:,} bytes per "
            f"token vs {base:,} in {base_name}: {base / mine:.2f}x the tokens")
