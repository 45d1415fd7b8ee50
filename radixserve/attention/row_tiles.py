"""The 32-row tile of deterministic mode: rows per call where a row's bits must not depend
on the other rows of the call.

CPU kernels pick their inner kernel (and so their summation order) by the call's shape, so
a row's result can change with the rows beside it. Calls of one fixed shape cannot: the
row-invariant linears (model/invariant_ops.py) run chunks of up to ROW_TILE rows, and
fixed-split attention (attention/fixed_split.py) multiplies in fp32 tiles of exactly
ROW_TILE rows, both zero-padding a short tile with `pad_rows`.

Only the tile is shared, not the call: a linear must call the layer's own forward per chunk
(its pre-packed oneDNN weight, and 1024/2048-row tiles for prefills, checked per weight
shape), while attention multiplies every tile in one batched matmul against a broadcast
operand.
"""

from __future__ import annotations

import torch

ROW_TILE = 32


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [..., R, K] with zero rows appended up to `rows` (x itself when R == rows)."""
    missing = rows - x.shape[-2]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-2], missing, x.shape[-1])], dim=-2)
