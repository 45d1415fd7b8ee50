#!/usr/bin/env python
"""The pieces of one lone decode token on SmolLM2-135M's shapes, each timed alone (eager).

What each costs per token, so that the compiled step's profile can be read against them:
- the attention's gather of every layer's cached K and V from the pool (``index_select``,
  the copy the compiled step made before this stop), at each ``--contexts`` length, slots
  in the allocator's order (a prompt's pages descending, then one up per token);
- the write-back of the new token's K/V into every layer of the pool from Python (what the
  compiled step's caller did before it stored them itself);
- the LM head [1, hidden] x [vocab, hidden] through the int4, int8, bf16 and fp32 kernels
  (llama.cpp reads its output weights at the GGUF's own type);
- RMSNorm and RoPE as eager calls (61 and 60 a token), for scale: compiled they fuse.

    python scripts/bench_lone_pieces.py --threads 1,2 --contexts 128,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from radixserve.attention.kv_pool import KVPool
from radixserve.model.rope import apply_rotary

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 30, 576, 9, 3, 64, 49152


def per_call_ms(fn, repeats: int) -> float:
    """Median wall ms of ``fn`` over ``repeats`` rounds of 20 calls (after one warm round)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times) * 1e3


def python_write_back(pool: KVPool, slot: torch.Tensor, new_k: torch.Tensor,
                      new_v: torch.Tensor) -> None:
    for layer in pool.layers:
        pool.write(layer, slot, new_k[layer:layer + 1], new_v[layer:layer + 1], decoded=False)


def allocator_slots(context: int) -> torch.Tensor:
    prompt = max(context - 8, 1)
    return torch.cat([torch.arange(prompt).flip(0), torch.arange(prompt, context)])


def head_kernels() -> dict[str, callable]:
    x32 = torch.randn(1, HIDDEN)
    w = torch.randn(VOCAB, HIDDEN) * 0.02
    x16 = x32.to(torch.bfloat16)
    w8 = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8)
    s8 = torch.rand(VOCAB, dtype=torch.bfloat16)
    q4 = torch.randint(0, 16, (VOCAB, HIDDEN), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.rand(HIDDEN // 32, VOCAB, 2, dtype=torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    return {
        "int4 (_weight_int4pack_mm_for_cpu, 14 MB)":
            lambda: torch._weight_int4pack_mm_for_cpu(x16, packed, 32, sz),
        "int8 (_weight_int8pack_mm, 28 MB)": lambda: torch._weight_int8pack_mm(x16, w8, s8),
        "bf16 (F.linear, 57 MB)": lambda: F.linear(x16, w16),
        "fp32 (F.linear, 113 MB)": lambda: F.linear(x32, w),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--contexts", default="128,512")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    pool = KVPool(LAYERS, max(contexts) + 16, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    for t in pool.k_flat + pool.v_flat:
        t.normal_()
    new_k, new_v = torch.randn(LAYERS, KV_HEADS, HEAD_DIM), torch.randn(LAYERS, KV_HEADS,
                                                                        HEAD_DIM)
    slot = torch.tensor([max(contexts)])
    h = torch.randn(1, HIDDEN)
    norm_w = torch.ones(HIDDEN)
    q = torch.randn(1, HEADS, HEAD_DIM)
    cos, sin = torch.randn(1, 1, HEAD_DIM // 2), torch.randn(1, 1, HEAD_DIM // 2)
    rows = []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for n in contexts:
            slots = allocator_slots(n)
            rows.append((threads, f"gather K+V, 30 layers, context {n} (60 index_select)",
                         per_call_ms(lambda: [t.index_select(0, slots) for t in
                                              pool.k_flat + pool.v_flat], args.repeats)))
        rows.append((threads, "write-back of the new K/V from Python, 30 layers (KVPool.write)",
                     per_call_ms(lambda: python_write_back(pool, slot, new_k, new_v),
                                 args.repeats)))
        for name, fn in head_kernels().items():
            rows.append((threads, f"LM head {name}", per_call_ms(fn, args.repeats)))
        rows.append((threads, "RMSNorm x61 (F.rms_norm, eager)",
                     per_call_ms(lambda: [F.rms_norm(h, (HIDDEN,), norm_w, 1e-5)
                                          for _ in range(61)], args.repeats)))
        rows.append((threads, "RoPE of q and k x30 (apply_rotary, eager)",
                     per_call_ms(lambda: [apply_rotary(q, cos, sin) for _ in range(60)],
                                 args.repeats)))
    print("| threads | piece (per token) | wall ms |")
    print("|---|---|---|")
    for threads, name, ms in rows:
        print(f"| {threads} | {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
