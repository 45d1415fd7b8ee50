"""The one 32-row tile of deterministic mode, shared by the linears and fixed-split attention."""

import torch

from radixserve.attention import fixed_split
from radixserve.attention.row_tiles import ROW_TILE, pad_rows
from radixserve.model import invariant_ops


def test_pad_rows_appends_zero_rows_on_the_row_dim_only():
    x = torch.randn(2, 3, 5, 7)
    padded = pad_rows(x, 8)
    assert padded.shape == (2, 3, 8, 7)
    assert torch.equal(padded[..., :5, :], x) and not padded[..., 5:, :].any()
    assert pad_rows(x, 5) is x


def test_both_users_take_the_same_tile():
    assert invariant_ops.SMALL_ROWS == ROW_TILE == 32
    assert invariant_ops.RowBlocks.safe().blocks(70) == [(0, 32, 32), (32, 32, 32), (64, 6, 32)]
    # fp32 attention products: a row's bits do not depend on how many rows share the call
    a, b = torch.randn(1, 70, 16), torch.randn(1, 16, 9)
    whole = fixed_split._row_invariant_matmul(a, b)
    assert torch.equal(whole[:, 3:4], fixed_split._row_invariant_matmul(a[:, 3:4], b))
