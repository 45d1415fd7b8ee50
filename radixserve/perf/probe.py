"""Measure this machine's rates for the roofline: GEMM GFLOP/s at a model's shapes, and the
memory bandwidth (a large sum, read only).

Each GEMM runs the kernel the model runs (``model.packed_linear.Linear``: oneDNN-packed
weights in bf16/fp16, ``F.linear`` otherwise) on a hot weight, best of a few repeats: the
machine's compute peak at that shape. The bandwidth is the best of a few reads of a buffer
far larger than the caches. Both use torch's current thread count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from radixserve.model.packed_linear import Linear
from radixserve.perf.roofline import MachinePeaks, ModelShape, weighted_gflops

__all__ = ["DECODE_SIZES", "GemmRate", "PREFILL_SIZES", "measure_bandwidth", "measure_gemms",
           "measure_peaks"]

DECODE_SIZES = (1, 8, 32, 64)
PREFILL_SIZES = (512, 1024, 2048)


@dataclass(frozen=True, slots=True)
class GemmRate:
    name: str
    m: int
    k: int
    n: int
    gflops: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def _best_seconds(fn: Callable[[], object], min_time: float, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / calls)
    return best


def measure_gemms(shape: ModelShape, dtype: torch.dtype, sizes: Sequence[int],
                  min_time: float = 0.02, repeats: int = 3) -> list[GemmRate]:
    """One rate per (M in ``sizes``, GEMM of the model)."""
    rates = []
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in shape.gemm_shapes().items():
        layer = Linear(k, n, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=gen) * k ** -0.5)
        layer = layer.to(dtype)
        layer.repack()
        for m in sizes:
            x = torch.randn(m, k, generator=gen).to(dtype)
            with torch.inference_mode():
                s = _best_seconds(lambda: layer(x), min_time, repeats)
            rates.append(GemmRate(name, m, k, n, 2.0 * m * k * n / s / 1e9))
    return rates


def measure_bandwidth(megabytes: int = 512, repeats: int = 3) -> float:
    """GB/s reading a ``megabytes`` float32 buffer (sum), best of ``repeats``."""
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    s = _best_seconds(lambda: buf.sum(), 0.0, repeats)
    return buf.numel() * 4 / s / 1e9


def layer_rate(rates: Sequence[GemmRate], m: int) -> float:
    """A layer's GEMMs at batch ``m`` together (LM head excluded): total FLOPs / time."""
    return weighted_gflops([(r.flops, r.gflops) for r in rates
                            if r.m == m and r.name != "lm_head"])


def measure_peaks(shape: ModelShape, dtype: torch.dtype, decode_batch: int,
                  prefill_batch: int) -> tuple[MachinePeaks, list[GemmRate]]:
    """The rates a workload's floor uses: the layer GEMMs at its decode batch and at its
    prefill chunk size, and the bandwidth."""
    rates = measure_gemms(shape, dtype, sorted({decode_batch, prefill_batch}))
    peaks = MachinePeaks(decode_gflops=layer_rate(rates, decode_batch),
                         prefill_gflops=layer_rate(rates, prefill_batch),
                         bandwidth_gbs=measure_bandwidth())
    return peaks, rates
