#!/usr/bin/env python
"""The CPU weight-only kernels against bf16 GEMM, by rows, at the default model's shapes:
why int4 decodes slower than bf16 from ~16 rows on a CPU without AMX (issue 41).

    PYTHONPATH=. python scripts/bench_linear_kernels.py            # ~1 min, run alone
    PYTHONPATH=. python scripts/bench_linear_kernels.py --rows 1,32 --threads 2

For each row count (a decode batch), the microseconds per call of one decoder layer's four
linears (fused q/k/v 960x576, o 576x576, fused gate/up 3072x576, down 576x1536) and of the
LM head (49152x576), with random weights:
- `bf16`: F.linear on bf16 weights (oneDNN; on a CPU with avx512_bf16 its dot products
  take two bf16 pairs per lane);
- `int4/g32`, `int4/g64`: torch's `_weight_int4pack_mm_for_cpu` at group 32 (GGUF's
  Q4 blocks, what `--weights-dtype int4` runs) and 64;
- `int8`: torch's `_weight_int8pack_mm` (weight-only int8, bf16 activations);
- `w8a8`: `torch._int_mm` on int8 weights with the activations quantized per row (an
  int8 x int8 product, VNNI where the CPU has it), scales applied after: the fastest
  kernel here from ~8 rows, but it needs int8 weights, 1.6x the Q4 file's bytes.
Ratios are bf16 time over each kernel's (above 1: faster than bf16), measured side by
side in this run. The weight-only kernels dequantize inside their fp32 FMA loop for each
block of rows, so their time grows with the rows while a bf16 GEMM's stays near its
memory floor up to tens of rows. Last, whether an installed torchao brings CPU kernels of
its own (its PyPI wheels carried CUDA kernels only when checked, 0.18.0).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

LAYER = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
LM_HEAD = [("lm_head", 49152, 576)]
KERNELS = ("bf16", "int4/g32", "int4/g64", "int8", "w8a8")     # kernels()' keys, in order


def per_call_us(fn, min_seconds: float = 0.2) -> float:
    """Median of five timings of a loop long enough to take `min_seconds`."""
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds / 5:
        fn()
        n += 1
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return sorted(times)[2] * 1e6


def kernels(out_f: int, in_f: int, rows: int) -> dict[str, callable]:
    """The candidate calls of one [out_f, in_f] linear on `rows` bf16 rows."""
    gen = torch.Generator().manual_seed(out_f * 7 + in_f)
    x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(torch.bfloat16)
    q4 = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 2)
    calls = {"bf16": lambda: F.linear(x, w)}
    for group in (32, 64):
        sz = torch.rand(in_f // group, out_f, 2, generator=gen).to(torch.bfloat16)
        calls[f"int4/g{group}"] = (lambda sz=sz, g=group:
                                   torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz))
    q8 = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
    s8 = (torch.rand(out_f, generator=gen) * 0.01).to(torch.bfloat16)
    calls["int8"] = lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8)
    q8t, s8f = q8.t().contiguous(), s8.float()

    def w8a8():
        xf = x.float()
        scale = xf.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        xq = (xf / scale).round_().to(torch.int8)
        return (torch._int_mm(xq, q8t).float() * (scale * s8f)).to(torch.bfloat16)

    calls["w8a8"] = w8a8
    return calls


def table(name: str, shapes, rows_list: list[int]) -> None:
    names = KERNELS
    print(f"\n{name}: us per call (ratio bf16 / kernel)")
    print(f"{'rows':>5} " + " ".join(f"{k:>17}" for k in names))
    for rows in rows_list:
        total = dict.fromkeys(names, 0.0)
        for _, out_f, in_f in shapes:
            for k, fn in kernels(out_f, in_f, rows).items():
                total[k] += per_call_us(fn)
        cells = [f"{total[k]:9.0f} ({total['bf16'] / total[k]:4.2f}x)" for k in names]
        print(f"{rows:>5} " + " ".join(f"{c:>17}" for c in cells), flush=True)


def torchao_cpu_ops() -> str:
    try:
        import torchao
    except ImportError:
        return "torchao: not installed"
    ops = [n for n in dir(torch.ops.torchao) if not n.startswith("_")]
    cpu = [n for n in ops if "cpu" in n or "da8w4" in n]
    return (f"torchao {torchao.__version__}: {len(ops)} ops registered, CPU ones: "
            f"{cpu or 'none'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    table("one decoder layer's linears (SmolLM2-135M)", LAYER, rows)
    table("the LM head", LM_HEAD, rows)
    print("\n" + torchao_cpu_ops())


if __name__ == "__main__":
    main()
