#!/usr/bin/env python
"""This machine's roofline for a model: GEMM GFLOP/s at the model's shapes (decode and
prefill batch sizes), memory bandwidth, and the floor of bench_engine.py's workload.

    python scripts/roofline.py [--dtype bfloat16] [--threads N]

Floors (radixserve/perf/roofline.py): prefill = its FLOPs (linears + causal attention) at
the layer GEMMs' rate at the chunk size; decode = per step, the larger of its FLOPs at the
rate at the decode batch and its bytes (every weight, every K/V byte of the batch, a shared
prompt once) at the bandwidth. Only ratios carry over between machines.
"""

from __future__ import annotations

import argparse

import torch

from radixserve.model.gguf_loader import load_gguf
from radixserve.model.registry import resolve_model_path
from radixserve.perf.probe import (DECODE_SIZES, PREFILL_SIZES, layer_rate, measure_bandwidth,
                                   measure_gemms)
from radixserve.perf.roofline import MachinePeaks, ModelShape, cache_on_and_off

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def model_shape(name: str) -> ModelShape:
    """The model's shape from its file's header (no weights read)."""
    path = resolve_model_path(name)
    if path.is_dir():
        from radixserve.model.hf_loader import read_hf_config
        return ModelShape.of(read_hf_config(path))
    return ModelShape.of(load_gguf(path, torch.float32).config)   # weights stay unread


def print_floor(shape: ModelShape, peaks: MachinePeaks, args, dtype_bytes: int) -> None:
    print(f"\nfloor of bench_engine.py's workload ({args.groups} x {args.per_group} requests, "
          f"{args.system}-token system prompts, {args.question}-token questions, "
          f"{args.output} output tokens)")
    print(f"{'cache':<7}{'prefill GFLOP':>14}{'prefill s':>11}{'decode GB':>11}"
          f"{'decode s':>10}{'floor s':>9}")
    floors = cache_on_and_off(shape, peaks, args.groups, args.per_group, args.system,
                              args.question, args.output, dtype_bytes)
    for cache, f in floors.items():
        gb = sum(s.bytes for s in f.decode_steps) / 1e9
        print(f"{cache:<7}{f.prefill.flops / 1e9:>14.0f}{f.prefill_s:>11.2f}"
              f"{gb:>11.1f}{f.decode_s:>10.2f}{f.total_s:>9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk size (tokens)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _DTYPES[args.dtype]
    shape = model_shape(args.model)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; "
          f"{args.model}: {shape.body_weights / 1e6:.1f}M layer weights + "
          f"{shape.head_weights / 1e6:.1f}M LM head")
    sizes = sorted(set(DECODE_SIZES) | set(PREFILL_SIZES) | {args.groups * args.per_group,
                                                             args.chunk})
    rates = measure_gemms(shape, dtype, sizes)
    names = list(shape.gemm_shapes())
    print(f"\nGEMM GFLOP/s (hot weights), {args.dtype}")
    print(f"{'M':>6}" + "".join(f"{n + ' ' + 'x'.join(map(str, shape.gemm_shapes()[n])):>19}"
                                for n in names) + f"{'layer':>8}")
    for m in sizes:
        row = {r.name: r.gflops for r in rates if r.m == m}
        print(f"{m:>6}" + "".join(f"{row[n]:>19.0f}" for n in names)
              + f"{layer_rate(rates, m):>8.0f}")
    bw = measure_bandwidth()
    print(f"\nmemory bandwidth (sum of 512 MiB): {bw:.1f} GB/s")
    peaks = MachinePeaks(decode_gflops=layer_rate(rates, args.groups * args.per_group),
                         prefill_gflops=layer_rate(rates, args.chunk), bandwidth_gbs=bw)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    weights_mb = (shape.body_weights + shape.head_weights) * dtype_bytes / 1e6
    print(f"weights read per decode step: {weights_mb:.0f} MB "
          f"({weights_mb / 1e3 / bw * 1e3:.1f} ms at that bandwidth); K/V per token "
          f"{shape.kv_bytes_per_token(dtype_bytes) / 1e3:.1f} kB")
    print_floor(shape, peaks, args, dtype_bytes)


if __name__ == "__main__":
    main()
