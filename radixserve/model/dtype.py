"""Choosing the working dtype: "auto" is decided by measurement, not by assumption.

On CPU, bf16 matmuls are several times faster than fp32 where the cores have AVX512-BF16
or AMX, and much slower where they have neither; a ~50 ms probe tells which machine this is.
"""

from __future__ import annotations

import time

import torch

from .errors import ModelLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
BF16_MIN_SPEEDUP = 1.2   # bf16 costs accuracy: take it on CPU only when clearly faster


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if cuda_native_bf16(device) else torch.float16
        return torch.bfloat16 if cpu_bf16_speedup() >= BF16_MIN_SPEEDUP else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(
            f"unknown dtype {dtype!r} (choose auto, {', '.join(DTYPES)})") from None


def cuda_native_bf16(device: torch.device) -> bool:
    """bf16 in hardware (compute capability 8.0+: Ampere, Hopper, ...) on this very device.

    Not torch.cuda.is_bf16_supported(): by default it also says yes where bf16 is only
    emulated (Turing, Volta), where fp16 runs on tensor cores and emulated bf16 does not.
    """
    if torch.version.hip:
        return True
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def cpu_bf16_speedup(m: int = 64, k: int = 1024, n: int = 2048, reps: int = 5) -> float:
    """fp32 time / bf16 time of a transformer-sized matmul on this CPU (best of `reps`)."""
    def best(dtype: torch.dtype) -> float:
        a = torch.randn(m, k).to(dtype)
        w = torch.randn(n, k).to(dtype)
        torch.nn.functional.linear(a, w)           # warm up (oneDNN primitive creation)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(a, w)
            times.append(time.perf_counter() - t0)
        return min(times)
    return best(torch.float32) / best(torch.bfloat16)
