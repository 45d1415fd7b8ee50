"""Deterministic mode's decode attention side by side with the default mode's, one layer:
64 decodes in 8 groups of 8 sharing a cached system prompt, ~100 private tokens each
(bench_attention.py's decode_shared shapes; SmolLM2-135M heads, bf16).

Backends, run interleaved (A, B, C, A, B, C, ...) so that load from other jobs hits all
alike; each call's CPU time (time.thread_time: torch runs on the calling thread with one
thread) after a cache flush; the median and the minimum are reported:
  default    TorchAttentionBackend as the engine builds it (cascade on, decodes grouped)
  grouped    FixedSplitBackend: shared whole 256-key chunks computed once per group
  ungrouped  FixedSplitBackend(group_decodes=False): every decode over its whole context
Also checks grouped == ungrouped bit for bit.

  python scripts/bench_det_attention.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench_attention import HEAD_DIM, HKV, HQ, CacheFlusher, make_case
from radixserve.attention import TorchAttentionBackend, build_metadata
from radixserve.attention.fixed_split import FixedSplitBackend
from radixserve.attention.kv_pool import KVPool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--flush-mib", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dt, ps = torch.bfloat16, args.page_size
    flush = CacheFlusher(args.flush_mib << 20)
    private = [int(x) for x in np.random.default_rng(1).integers(90, 111, size=64)]
    kw = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM)
    backends = {"default": TorchAttentionBackend(**kw, cascade_prefills=False),
                "grouped": FixedSplitBackend(**kw),
                "ungrouped": FixedSplitBackend(**kw, group_decodes=False)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), page size {ps}, "
          f"bf16, {args.repeats} interleaved rounds, CPU ms per layer (median / min)")
    for prefix in (1024, 1008):
        case = make_case("decode", 8, 8, prefix, private, 1, True, ps)
        gen = torch.Generator().manual_seed(0)
        pool = KVPool(1, case.num_slots // ps, ps, HKV, HEAD_DIM, dt, "cpu")
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
        q = torch.randn(64, HQ, HEAD_DIM, generator=gen).to(dt)
        k, v = (torch.randn(64, HKV, HEAD_DIM, generator=gen).to(dt) for _ in "kv")
        meta = build_metadata(case.spans, ps, "cpu")
        plans = {name: b.prepare(meta) for name, b in backends.items()}
        outs = {name: b.forward(plans[name], 0, q, k, v, pool)      # warm-up
                for name, b in backends.items()}
        assert torch.equal(outs["grouped"], outs["ungrouped"])
        times: dict[str, list[float]] = {name: [] for name in backends}
        for _ in range(args.repeats):
            for name, b in backends.items():
                flush()
                t0 = time.thread_time()
                b.forward(plans[name], 0, q, k, v, pool)
                times[name].append((time.thread_time() - t0) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"prefix {prefix} + ~100 private (kv ~{int(np.mean(meta.kv_lens))}): " + ", ".join(
            f"{name} {med[name]:.2f} / {min(times[name]):.2f}" for name in backends)
              + f"; grouped/default {med['grouped'] / med['default']:.2f}x, "
              f"ungrouped/default {med['ungrouped'] / med['default']:.2f}x, "
              f"grouped == ungrouped bitwise")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
