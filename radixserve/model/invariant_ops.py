"""Batch-invariant linear layers for deterministic mode: a row's result never depends on
how many other rows are multiplied with it.

oneDNN's CPU matmul (brg_matmul, AMX on this machine) picks its blocking from the shape,
and some blockings sum a row's products in another order. Measured on an AMX Xeon, torch
2.13 / oneDNN 3.12, SmolLM2-135M's five weight shapes, 1 and 2 threads
(docs/deterministic.md): in bf16, every call with M <= 32 rows gives each row exactly what a
1-row call gives, and so do M = 1024 and M = 2048, but 33 <= M <= ~700 does not (nor do some
larger M: 1611 rows of the fused q/k/v weight at 2 threads); in fp16 any M >= 2 agrees but
M = 1 does not; in fp32, calls of exactly 32 rows and of 1024 agree. So rows are computed in
*blocks*: whole tiles of the largest big size, then the rest in one padded tile of the
smallest big size that holds it when it is large enough that padding is cheaper than many
small calls, else in chunks of at most ``small_rows`` (padded up to ``min_rows``). One
2,048-row call costs 0.5-0.9x two 1,024-row calls here (oneDNN reorders an unpacked weight
on every call), and a full prefill step is 2,048 rows. Every block shape used is one that
``check_row_invariance`` found equal to the small chunks on this machine, and the small
chunks' own padding one that ``small_chunks_agree`` found equal to 32-row calls (on an
AVX512-BF16 CPU without AMX, bf16's 1- and 2-row calls of the down projection are not:
its small chunks are padded to 32 there); when none does, ``RowBlocks.safe()`` (fixed
32-row tiles, always padded: one kernel shape) is used instead.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.row_tiles import ROW_TILE, pad_rows

log = logging.getLogger(__name__)

# Smallest chunk that computes like a 1-row call, per dtype (measured, see module doc).
_MIN_ROWS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 32}
SMALL_ROWS = ROW_TILE           # the small chunk: the tile fixed-split attention uses too
BIG_ROWS = (1024, 2048)         # tile sizes tried, smallest first (checked per weight shape)


@dataclass(frozen=True)
class RowBlocks:
    """How a linear layer's rows are cut into calls (see module doc)."""

    small_rows: int = SMALL_ROWS
    min_rows: int = 1              # chunks shorter than this are padded with zero rows
    big_rows: tuple[int, ...] = BIG_ROWS  # tile sizes, ascending; (): small chunks only
    pad_big_from: int = BIG_ROWS[0] // 4  # a rest of at least this many rows: one padded tile

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, big_rows: tuple[int, ...] = BIG_ROWS,
                  min_rows: int | None = None) -> RowBlocks:
        return cls(min_rows=_MIN_ROWS.get(dtype, SMALL_ROWS) if min_rows is None else min_rows,
                   big_rows=big_rows)

    @classmethod
    def safe(cls) -> RowBlocks:
        """One kernel shape only (32 rows, padded): slow for prefills, invariant by design."""
        return cls(min_rows=SMALL_ROWS, big_rows=())

    def blocks(self, rows: int) -> list[tuple[int, int, int]]:
        """(start, real rows, rows in the call) for every call over ``rows`` rows."""
        out, start = [], 0
        if self.big_rows:
            largest = self.big_rows[-1]
            while rows - start >= largest:
                out.append((start, largest, largest))
                start += largest
            rest = rows - start
            if rest >= self.pad_big_from:
                tile = next(t for t in self.big_rows if t >= rest)
                out.append((start, rest, tile))
                return out
        while start < rows:
            n = min(self.small_rows, rows - start)
            out.append((start, n, max(n, self.min_rows)))
            start += n
        return out


def blocked_linear(x: torch.Tensor, linear: nn.Linear,
                   row_blocks: RowBlocks) -> torch.Tensor:
    """``linear`` over the rows of a 2-D ``x``, one call per block of ``row_blocks``.

    Small chunks run the layer's own forward (a pre-packed oneDNN weight where
    packed_linear keeps one: packing's decode speed, the same bits as F.linear up to 32
    rows); big tiles run F.linear, whose 1024- and 2048-row kernels agree with the small
    chunks where the packed one may not. ``check_row_invariance`` checks exactly these
    calls."""
    rows = x.shape[0]
    out = x.new_empty(rows, linear.weight.shape[0])
    for start, real, call_rows in row_blocks.blocks(rows):
        part = x[start:start + real]
        part = pad_rows(part, call_rows)
        call = (linear if call_rows <= row_blocks.small_rows
                else lambda t: F.linear(t, linear.weight, linear.bias))
        if call_rows == real == rows:
            return call(part)
        out[start:start + real] = call(part)[:real]
    return out


class RowInvariantLinear(nn.Module):
    """An nn.Linear (shared, not copied: same parameters, same packed weight) applied by
    ``blocked_linear``."""

    def __init__(self, linear: nn.Linear, row_blocks: RowBlocks) -> None:
        super().__init__()
        self.linear = linear
        self.row_blocks = row_blocks

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = blocked_linear(flat, self.linear, self.row_blocks)
        return y.view(*x.shape[:-1], y.shape[-1])


def check_row_invariance(linear: nn.Linear, row_blocks: RowBlocks, seed: int = 0) -> bool:
    """Whether every call shape ``row_blocks`` uses from ``small_rows`` up gives, on random
    rows, exactly what the small chunks give (the kernel choice depends on the shape, not the
    data). Chunks of fewer rows are ``small_chunks_agree``'s, checked first and over many
    more rows."""
    g = torch.Generator().manual_seed(seed)
    weight = linear.weight
    big = max(row_blocks.big_rows, default=0)
    rows = big + 3 * row_blocks.small_rows + 5
    x = torch.randn(rows, weight.shape[1], generator=g).to(weight.dtype).to(weight.device)
    reference = blocked_linear(x, linear, RowBlocks(row_blocks.small_rows,
                                                    row_blocks.min_rows, ()))
    sizes = {row_blocks.small_rows, row_blocks.small_rows + 1, rows}
    for tile in row_blocks.big_rows:    # each tile whole, and padded
        sizes |= {tile, tile - 1}
    for n in sorted(sizes):
        for start in dict.fromkeys((0, rows - n)):     # once when n == rows
            got = blocked_linear(x[start:start + n], linear, row_blocks)
            if not torch.equal(got, reference[start:start + n]):
                return False
    return True


# Small-chunk sizes checked over many rows by small_chunks_agree (every size would cost
# ~4x the calls for no kernel shape not already among these).
_SMALL_SIZES = (1, 2, 3, 5, 8, 13, 17, SMALL_ROWS - 1)


def small_chunks_agree(linear: nn.Linear, min_rows: int, seed: int = 1) -> bool:
    """Whether chunks of fewer than ``SMALL_ROWS`` rows, padded to ``min_rows``, give every
    row exactly what ``SMALL_ROWS``-row chunks give, each size over all of ~128k random
    outputs (32-256 rows). A kernel that sums in another order shows only as rare 1-ulp
    flips in bf16 (on an AVX512-BF16 CPU without AMX, 1- and 2-row calls of the 1,536-wide
    down projection differ so), which the few rows per size that ``check_row_invariance``
    takes can miss."""
    g = torch.Generator().manual_seed(seed)
    weight = linear.weight
    rows = max(SMALL_ROWS, min(256, 2**17 // weight.shape[0]))
    x = torch.randn(rows, weight.shape[1], generator=g).to(weight.dtype).to(weight.device)
    reference = blocked_linear(x, linear, RowBlocks(SMALL_ROWS, min_rows, ()))
    return all(torch.equal(blocked_linear(x, linear, RowBlocks(n, min_rows, ())), reference)
               for n in _SMALL_SIZES if max(n, min_rows) < SMALL_ROWS)


def choose_row_blocks(linear: nn.Linear) -> RowBlocks:
    """The measured blocks for the weight's dtype when this machine confirms them at this
    thread count (``small_chunks_agree``, then ``check_row_invariance``): small chunks padded
    to the dtype's measured ``min_rows``, else always to ``SMALL_ROWS`` (one kernel shape);
    with 1,024- and 2,048-row tiles, else 1,024 only; else ``RowBlocks.safe()`` (e.g. 3
    threads made oneDNN split the 1024-row tile of a 576-wide output differently)."""
    weight = linear.weight
    for min_rows in dict.fromkeys((_MIN_ROWS.get(weight.dtype, SMALL_ROWS), SMALL_ROWS)):
        if not small_chunks_agree(linear, min_rows):
            continue
        for big_rows in (BIG_ROWS, BIG_ROWS[:1]):
            blocks = RowBlocks.for_dtype(weight.dtype, big_rows, min_rows)
            if check_row_invariance(linear, blocks):
                return blocks
    log.warning("linear %s in %s: row blocks %s are not row-invariant here; using fixed "
                "32-row tiles", tuple(weight.shape), weight.dtype, blocks)
    return RowBlocks.safe()


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 GEMMs natively (AVX512-BF16 or AMX). Without either,
    oneDNN emulates bf16 and its kernels were measured not row-invariant (an Intel Xeon with
    AVX512 but no AVX512-BF16: rows change with the call's size at 3 threads), so
    deterministic mode refuses bf16 there."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def deterministic_dtype_error(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why --deterministic cannot promise batch invariance for linears of `dtype` here, or
    None (weight-only int4/int8 kernels are row-invariant on every CPU: not asked)."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_bf16_cpu():
        return ("--deterministic in bfloat16 needs a CPU with AVX512-BF16 or AMX (this one "
                "emulates bf16, and its bf16 GEMMs are not row-invariant); use --dtype "
                "float16 or float32")
    return None


# Row blocks already chosen in this process, by what decides the kernels (weight shape,
# dtype, device, bias, packed or not, thread count), never by the weights' values. Checking
# costs real time (an fp16 LM head's 2,149-row calls are emulated GEMMs: most of
# tests/engine/test_deterministic.py's fp16 test went here, once per engine), so engines
# built on the same kind of model check once.
_CHOSEN: dict[tuple, RowBlocks] = {}


def _kernel_key(linear: nn.Linear) -> tuple:
    w = linear.weight
    return (tuple(w.shape), w.dtype, str(w.device), linear.bias is not None,
            getattr(linear, "_packed", None) is not None, torch.get_num_threads())


def row_invariant_model(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree whose nn.Linear layers are RowInvariantLinear; the
    parameters and buffers are shared with ``model`` (no memory), which is left unchanged.
    Row blocks are chosen once per kind of weight and process (``choose_row_blocks``)."""
    chosen = _CHOSEN

    def convert(module: nn.Module) -> nn.Module:
        if hasattr(module, "row_invariant_form"):      # a layer that picks by row count
            return convert(module.row_invariant_form())
        if isinstance(module, nn.Linear):
            w = module.weight
            if (reason := deterministic_dtype_error(w.dtype, w.device)) is not None:
                raise ValueError(reason)
            key = _kernel_key(module)
            if key not in chosen:
                chosen[key] = choose_row_blocks(module)
            return RowInvariantLinear(module, chosen[key])
        clone = copy.copy(module)
        clone._modules = {name: (convert(child) if child is not None else None)
                          for name, child in module._modules.items()}
        return clone

    with torch.inference_mode():
        return convert(model)
