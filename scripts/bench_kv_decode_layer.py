"""One layer's decode attention over bf16 vs 8-bit KV: where 8-bit KV's extra decode time goes.

The shapes of `bench_kv_quant.py`'s decode step on SmolLM2-135M (batch 32, ~520 tokens of
context, 9 query / 3 KV heads of 64), bf16 compute, one thread, CPU time (thread_time),
formats interleaved round-robin, medians.

    python scripts/bench_kv_decode_layer.py
    python scripts/bench_kv_decode_layer.py --formats bfloat16,int8 --rounds 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.kv_sizing import KVFormat

FORMATS = {"bfloat16": ("bfloat16", "bfloat16"), "fp8_e4m3": ("fp8_e4m3", "fp8_e4m3"),
           "int8": ("int8", "int8"), "k_bf16_v_fp8_e4m3": ("bfloat16", "fp8_e4m3")}
DEFAULT = "bfloat16,fp8_e4m3,int8,k_bf16_v_fp8_e4m3"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default=DEFAULT)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=520)
    p.add_argument("--heads", default="9,3", help="query heads, KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=5, help="forward calls per timed sample")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def setup(fmt: tuple[str, str], args, hq: int, hkv: int, gen: torch.Generator):
    b, ctx, d = args.batch, args.context, args.head_dim
    pool = KVPool(1, b * ctx, 1, hkv, d, torch.bfloat16, "cpu", kv_format=KVFormat(*fmt))
    slots = torch.arange(b * ctx)
    pool.write(0, slots, torch.randn(len(slots), hkv, d, generator=gen).bfloat16(),
               torch.randn(len(slots), hkv, d, generator=gen).bfloat16())
    backend = TorchAttentionBackend(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    spans = [SeqSpan(np.arange(i * ctx, (i + 1) * ctx, dtype=np.int32), ctx - 1, 1)
             for i in range(b)]
    plan = backend.prepare(build_metadata(spans, 1, "cpu"))
    q = torch.randn(b, hq, d, generator=gen).bfloat16()
    kv = torch.randn(b, hkv, d, generator=gen).bfloat16()
    return lambda: backend.forward(plan, 0, q, kv, kv, pool)


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv = (int(x) for x in args.heads.split(","))
    names = [n.strip() for n in args.formats.split(",")]
    gen = torch.Generator().manual_seed(0)
    runs = {n: setup(FORMATS[n], args, hq, hkv, gen) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            started = time.thread_time()
            for _ in range(args.calls):
                runs[n]()
            times[n].append((time.thread_time() - started) / args.calls * 1e3)
    base = statistics.median(times[names[0]])
    for n in names:
        m = statistics.median(times[n])
        print(f"{n:24s} {m:7.3f} ms per layer  {m / base:.2f}x {names[0]}")


if __name__ == "__main__":
    main()
