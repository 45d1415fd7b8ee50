"""What every KV pool's storage shares (the full-KV pool, kv_pool.py; the latent pool,
latent_pool.py): dtype names, size checks, and zero-filled tensors that cost nothing on CPU
until written."""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["as_dtype", "check_positive", "zeros"]

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name (ValueError naming the choices)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of "
                         f"{sorted(set(_DTYPE_NAMES))}") from None


def check_positive(**values: int) -> None:
    """ValueError naming the first value that is not a positive int."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor: padded gathers read unwritten slots with weight 0, and
    0 * NaN garbage would still poison the output.

    On CPU the memory is an anonymous mapping, which the kernel zero-fills page by page on
    first touch: a 4 GiB pool costs nothing until tokens are written, where torch.zeros
    writes every byte up front (~7 s for the default CPU pool on 2 cores).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, numel * itemsize), dtype=dtype,
                            count=numel).view(shape)
