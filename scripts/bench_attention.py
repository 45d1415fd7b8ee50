"""Time one layer of the torch attention backend with and without cascade (shared-prefix)
attention, on the shapes of the engine benchmark (SmolLM2-135M: 9 q heads, 3 kv heads,
head_dim 64, bf16).

Cases:
  prefill_shared  32 prefill spans x 64 new tokens over one shared 1,024-token cached prefix
  decode_shared   64 decodes in 8 groups, each group sharing 1,024 tokens, + ~100 private
  prefill_private the prefill case with every span's prefix on its own pages
  decode_private  the decode case with every sequence on its own pages

Reports the best of --repeats forward() times (K/V write + attention; prepare() excluded and
timed separately), old (cascade=False) vs new, their ratio, and the max output difference.
Caches are flushed before each timed call (--flush-mib), as a layer's K/V are cold in the
engine.

  python scripts/bench_attention.py --quick          # seconds-long smoke run
  OMP_NUM_THREADS=2 python scripts/bench_attention.py --threads 2 --repeats 20
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.attention import SeqSpan, TorchAttentionBackend, build_metadata
from radixserve.attention.kv_pool import KVPool

HQ, HKV, HEAD_DIM = 9, 3, 64


@dataclass
class Case:
    name: str
    spans: list[SeqSpan]
    num_slots: int


def _page_ids(rng: np.random.Generator, counts: list[int], num_pages: int) -> list[np.ndarray]:
    """Disjoint page-id arrays of the given lengths, scattered over the pool."""
    perm = rng.permutation(num_pages).astype(np.int32)
    return np.split(perm[:sum(counts)], np.cumsum(counts)[:-1])


def make_case(name: str, groups: int, per_group: int, prefix: int, private: list[int],
              new_len: int, shared: bool, page_size: int, seed: int = 0) -> Case:
    """``groups * per_group`` sequences: ``prefix`` tokens (shared within a group when
    ``shared``), then ``private[i]`` cached tokens of their own, then ``new_len`` new ones."""
    rng = np.random.default_rng(seed)
    n = groups * per_group
    ceil = lambda x: -(-x // page_size)  # noqa: E731
    prefix_pages = prefix // page_size
    assert prefix_pages * page_size == prefix, "prefix must be whole pages"
    own = [ceil(prefix + private[i] + new_len) - prefix_pages for i in range(n)]
    heads = [prefix_pages] * (groups if shared else n)
    num_pages = sum(heads) + sum(own) + 8
    ids = _page_ids(rng, heads + own, num_pages)
    head_ids, own_ids = ids[:len(heads)], ids[len(heads):]
    spans = []
    for i in range(n):
        head = head_ids[i // per_group] if shared else head_ids[i]
        spans.append(SeqSpan(np.concatenate([head, own_ids[i]]),
                             cached_len=prefix + private[i], new_len=new_len))
    return Case(name, spans, num_pages * page_size)


def cases(page_size: int) -> list[Case]:
    rng = np.random.default_rng(1)
    private = [int(x) for x in rng.integers(90, 111, size=64)]
    out = []
    for shared in (True, False):
        tag = "shared" if shared else "private"
        out.append(make_case(f"prefill_{tag}", 1, 32, 1024, [0] * 32, 64, shared, page_size))
        out.append(make_case(f"decode_{tag}", 8, 8, 1024, private, 1, shared, page_size))
    return out


class CacheFlusher:
    """Writes a buffer larger than the last-level cache: in the engine a layer's K/V are
    cold when its attention runs (29 other layers and the MLP weights came in between), so
    timing the same layer back to back with a warm cache flatters gather-heavy code."""

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes // 8 if nbytes else 0, dtype=torch.int64)

    def __call__(self) -> None:
        if self.buf.numel():
            self.buf.add_(1)


def best_ms(fn, repeats: int, flush: CacheFlusher) -> float:
    fn()                                            # warm-up: scratch buffers, page faults
    times = []
    for _ in range(repeats):
        flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def run_case(case: Case, page_size: int, repeats: int, dtype: torch.dtype,
             flush: CacheFlusher) -> dict:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, case.num_slots // page_size, page_size, HKV, HEAD_DIM, dtype, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    t = sum(s.new_len for s in case.spans)
    q = torch.randn(t, HQ, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(t, HKV, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(t, HKV, HEAD_DIM, generator=gen).to(dtype)
    meta = build_metadata(case.spans, page_size, "cpu")
    row: dict = {"case": case.name}
    outs = {}
    for label, cascade in (("old", False), ("new", True)):
        # "new" as the engine builds it (create_backend): prefills join groups in fp32 only.
        backend = TorchAttentionBackend(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                        cascade=cascade,
                                        cascade_prefills=dtype == torch.float32)
        row[f"prep_{label}"] = best_ms(lambda: backend.prepare(meta), repeats, flush)
        prepared = backend.prepare(meta)
        row[f"fwd_{label}"] = best_ms(
            lambda: backend.forward(prepared, 0, q, k, v, pool), repeats, flush)
        outs[label] = backend.forward(prepared, 0, q, k, v, pool)
        if cascade:
            row["groups"] = len(prepared.cascade_groups)
    row["max_diff"] = (outs["old"].float() - outs["new"].float()).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats: a seconds-long smoke run")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    ap.add_argument("--flush-mib", type=int, default=64,
                    help="write this much memory before each timed call (0: warm cache)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats
    dtype = getattr(torch, args.dtype)
    flush = CacheFlusher(args.flush_mib << 20)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, page_size "
          f"{args.page_size}, {args.dtype}, best of {repeats}; one layer, "
          f"{HQ} q / {HKV} kv heads, head_dim {HEAD_DIM}; caches flushed with "
          f"{args.flush_mib} MiB before each call")
    print(f"{'case':16s} {'old ms':>8s} {'new ms':>8s} {'speedup':>8s} {'prep old':>9s} "
          f"{'prep new':>9s} {'groups':>6s} {'max diff':>9s}")
    for case in cases(args.page_size):
        if args.only and args.only not in case.name:
            continue
        r = run_case(case, args.page_size, repeats, dtype, flush)
        print(f"{r['case']:16s} {r['fwd_old']:8.2f} {r['fwd_new']:8.2f} "
              f"{r['fwd_old'] / r['fwd_new']:7.2f}x {r['prep_old']:9.2f} {r['prep_new']:9.2f} "
              f"{r['groups']:6d} {r['max_diff']:9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
