#!/usr/bin/env python
"""What else could make 8-bit KV agree longer with bf16 KV: alternatives to the shipped
codec, simulated ("fake quantization") and measured with bench_kv_quant.py's own metrics.

Each variant rounds K and/or V the way it would be stored and keeps the rounded values in
an fp32 pool, so attention sees exactly what a real implementation would decode:
- fp8_amax: the shipped rule (per token and KV head, amax at the top code), for reference;
- fp8_mse: per token and head, the scale among amax x {1, .95, .9, .85, .8, .7, .6} with
  the least squared error (clipping outliers for finer steps);
- fp8_hadamard: K and V rotated per head by an orthonormal Hadamard matrix before rounding
  and back after (equal to rotating q and the output, as QuaRot does);
- fp8_stochastic: stochastic instead of nearest rounding;
- int8_amax, int8_hadamard, kbf16_vfp8: int8 without and with the rotation; K unrounded
  with V in fp8.

    python scripts/kv_quant_variants.py --text-tokens 1024            # KL etc. only
    python scripts/kv_quant_variants.py --prompts 32 --greedy fp8_amax,fp8_hadamard
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kv_quant as bench                                    # noqa: E402
from radixserve.model import load_model                          # noqa: E402

Rounding = Callable[[torch.Tensor], torch.Tensor]


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def fp8_e4m3(y: torch.Tensor, stochastic: bool, gen: torch.Generator) -> torch.Tensor:
    if stochastic:      # +-half a step of noise, then nearest: rounds up with p = fraction
        step = 2.0 ** (torch.floor(torch.log2(y.abs().clamp_min(2**-6))) - 3)
        y = (y + (torch.rand(y.shape, generator=gen) - 0.5) * step).clamp(-448, 448)
    return y.to(torch.float8_e4m3fn).float()


def rounding(fmt: str, *, rotate: bool = False, mse: bool = False,
             stochastic: bool = False) -> Rounding:
    top = 448.0 if fmt == "fp8" else 127.0
    gen = torch.Generator().manual_seed(0)

    def at_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = (x / scale).clamp(-top, top)
        return (fp8_e4m3(y, stochastic, gen) if fmt == "fp8" else y.round()) * scale

    def apply(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        h = hadamard(xf.shape[-1]) if rotate else None
        if h is not None:
            xf = xf @ h
        amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        out = at_scale(xf, amax / top)
        if mse:
            err = ((out - xf) ** 2).sum(-1, keepdim=True)
            for ratio in (0.95, 0.9, 0.85, 0.8, 0.7, 0.6):
                cand = at_scale(xf, amax * ratio / top)
                cand_err = ((cand - xf) ** 2).sum(-1, keepdim=True)
                out = torch.where(cand_err < err, cand, out)
                err = torch.minimum(cand_err, err)
        if h is not None:
            out = out @ h.T
        return out.to(x.dtype)
    return apply


VARIANTS: dict[str, tuple[Rounding | None, Rounding | None]] = {
    "fp8_amax": (rounding("fp8"),) * 2,
    "fp8_mse": (rounding("fp8", mse=True),) * 2,
    "fp8_hadamard": (rounding("fp8", rotate=True),) * 2,
    "fp8_stochastic": (rounding("fp8", stochastic=True),) * 2,
    "int8_amax": (rounding("int8"),) * 2,
    "int8_hadamard": (rounding("int8", rotate=True),) * 2,
    "kbf16_vfp8": (None, rounding("fp8")),
}


class FakeQuantRunner(bench.Runner):
    """bench.Runner over an fp32 pool that stores K/V rounded by a variant."""

    def __init__(self, loaded, variant: str, batch: int, max_len: int):
        super().__init__(loaded, ("float32", "float32"), batch, max_len)
        k_round, v_round = VARIANTS[variant]
        write = self.pool.write

        def rounded_write(layer, slots, k, v, **options):
            return write(layer, slots, k if k_round is None else k_round(k),
                         v if v_round is None else v_round(v), **options)
        self.pool.write = rounded_write


REAL_RUNNER = bench.Runner


def runner_factory(loaded, fmt, batch, max_len):
    """bench's Runner for its formats, FakeQuantRunner for a variant's name."""
    if isinstance(fmt, str):
        return FakeQuantRunner(loaded, fmt, batch, max_len)
    return REAL_RUNNER(loaded, fmt, batch, max_len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text-tokens", type=int, default=1024)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=0, help="greedy prompts (0: skip)")
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--greedy", default="fp8_amax,fp8_hadamard",
                   help="variants to run greedy agreement for")
    args = p.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        bench.FORMATS[v] = v                      # a str format: FakeQuantRunner
    bench.Runner = runner_factory
    loaded = load_model(args.model, dtype="float32")
    ids = loaded.tokenizer.encode(bench.TEXT.read_text())[:args.text_tokens]
    names = ["float32", "bfloat16", *variants]
    quality = bench.teacher_forced(loaded, ids, 512, names)
    print("| KV | max abs logit err | mean abs logit err | mean KL vs bf16 KV |")
    print("|---|---|---|---|")
    for n in names:
        q = quality[n]
        print(f"| {n} | {q['max_abs_logit_err']:.3f} | {q['mean_abs_logit_err']:.4f} | "
              f"{q['mean_kl']:.2e} |", flush=True)
    if not args.prompts:
        return
    step = (len(ids) - 64) // args.prompts
    prompts = [ids[i * step:i * step + 64] for i in range(args.prompts)]
    greedy_names = ["float32", "bfloat16", *args.greedy.split(",")]
    outs = {n: bench.greedy(loaded, prompts, args.greedy_tokens, bench.FORMATS[n])
            for n in greedy_names}
    for n in greedy_names:
        agree = bench.agreement(outs[n], outs["float32" if n == "bfloat16" else "bfloat16"])
        print(f"{n}: greedy agreement mean {statistics.mean(agree):.1f}, min {min(agree)}, "
              f"identical {sum(a == args.greedy_tokens for a in agree)}", flush=True)


if __name__ == "__main__":
    main()
