#!/usr/bin/env python
"""flashinfer with a hybrid model's window classes and a soft-cap, against the torch backend.

For a lent GPU (issue 33): one backend built for a Gemma-like layer layout (two
sliding-window layers of two sizes, 64 and 32, around a global one; Gemma 3's head_dim 256
and 4/1 heads; with and without Gemma 2's attention logit soft-cap 50) runs prefills longer
than the windows, a chunk continuing a cached prefix and decodes past them, and each layer's
output is compared with the torch backend's fp32 result on the same pool. One JSON line per
case, then a summary line; exit 1 if a case is off. The `windowed_pool` cases read the local
layers as the per-group window pool does (attention/window_kv.py): one pool kept at the
largest window for both sizes, every page wholly before a span's window (the largest) mapped
to a null page that is never written, so only each layer's own window mask keeps it out.
`scripts/gpu_check.py --sections windows` runs the same cases as its `windows` section.

    python scripts/gpu_check_hybrid.py              # CUDA with flashinfer installed
    python scripts/gpu_check_hybrid.py --dry-run    # CPU: the torch backend stands in
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from radixserve.attention import create_backend
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import SeqSpan, build_metadata

WINDOW = 64
LAYOUT = [WINDOW, None, WINDOW // 2]      # local, global, local of another window size
HQ, HKV, D = 4, 1, 256                    # Gemma 3 270M's heads
LENS = [(0, 200), (150, 40), (300, 1), (90, 1), (10, 1)]   # (cached, new)
# bf16 kernel vs fp32 torch: |o| <~ 3 here, bf16 unit roundoff 2^-8 on scores, probabilities
# and the output (the bound in scripts/gpu_check.py: attention_error_bound) stays below this.
ATOL_BF16 = 0.05


def scenario(pool: KVPool, seed: int, device: str):
    """Spans over scattered pages, their cached prefixes written into every layer."""
    gen = torch.Generator().manual_seed(seed)
    perm = np.random.default_rng(seed).permutation(pool.num_pages).astype(np.int32)
    spans, q, k, v, off = [], [], [], [], 0
    for cached, new in LENS:
        n_pages = -(-(cached + new) // pool.page_size)
        pages, off = perm[off:off + n_pages], off + n_pages
        fk, fv = (torch.randn(cached + new, HKV, D, generator=gen) for _ in range(2))
        pos = np.arange(cached)
        slots = torch.from_numpy(pages[pos // pool.page_size].astype(np.int64)
                                 * pool.page_size + pos % pool.page_size).to(device)
        for layer in range(len(LAYOUT)):
            pool.write(layer, slots, fk[:cached].to(device, pool.dtype),
                       fv[:cached].to(device, pool.dtype))
        spans.append(SeqSpan(pages, cached, new))
        q.append(torch.randn(new, HQ, D, generator=gen))
        k.append(fk[cached:])
        v.append(fv[cached:])
    return spans, torch.cat(q), torch.cat(k), torch.cat(v)


def window_spans(spans: list[SeqSpan], page_size: int, null: int) -> list[SeqSpan]:
    """The spans as the window pool's page table reads them: pages wholly before the first
    query's window (cached_len - W) point at the `null` page."""
    out = []
    for s in spans:
        pages = np.array(s.pages, dtype=np.int32)
        pages[:max(0, s.cached_len - WINDOW + 1) // page_size] = null
        out.append(SeqSpan(pages, s.cached_len, s.new_len))
    return out


def outputs(name: str, dtype: torch.dtype, page_size: int, soft_cap: float | None,
            device: str, windowed_pool: bool = False) -> list[torch.Tensor]:
    """Each layer's attention output (fp32) from backend ``name`` on a fresh pool; with
    `windowed_pool` the local layer reads through a null-mapped page table."""
    backend = create_backend(name, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=dtype,
                             device=device, layer_windows=LAYOUT, logits_soft_cap=soft_cap)
    pool = KVPool(len(LAYOUT), sum(-(-(c + n) // page_size) for c, n in LENS) + 4, page_size,
                  HKV, D, dtype, device)
    spans, q, k, v = scenario(pool, seed=page_size, device=device)
    plan = backend.prepare(build_metadata(spans, page_size, device))
    plans = [plan] * len(LAYOUT)
    if windowed_pool:       # a page no span uses: never written, all zeros
        used = np.concatenate([np.asarray(s.pages) for s in spans])
        null = int(np.setdiff1d(np.arange(pool.num_pages), used)[0])
        local = backend.prepare(build_metadata(window_spans(spans, page_size, null),
                                               page_size, device))
        plans = [plan if w is None else local for w in LAYOUT]   # one table, both sizes
    return [backend.forward(plans[layer], layer, *(x.to(device, dtype) for x in (q, k, v)),
                            pool).float().cpu() for layer in range(len(LAYOUT))]


def rows(device: str, name: str, quick: bool = False):
    """One result per case and layer (a dict with `ok`); `quick`: the window pool's table
    at page size 16 only (a CPU dry run of the plumbing)."""
    cases = [(s, p, False) for s in (None, 50.0) for p in (1, 16)]
    cases += [(None, p, True) for p in (1, 16)]         # the per-group window pool's table
    if quick:
        cases = [(None, 16, True)]
    for soft_cap, page_size, windowed_pool in cases:
        got = outputs(name, torch.bfloat16, page_size, soft_cap, device, windowed_pool)
        ref = outputs("torch", torch.float32, page_size, soft_cap, "cpu")
        for layer, (g, r) in enumerate(zip(got, ref)):
            err = (g - r).abs().max().item()
            yield {"layer": layer, "window": LAYOUT[layer], "soft_cap": soft_cap,
                   "page_size": page_size, "backend": name,
                   "windowed_pool": windowed_pool,
                   "max_abs_err_vs_torch_fp32": round(err, 5), "ok": err < ATOL_BF16}


def check_windows(report: dict, device: str) -> None:
    """scripts/gpu_check.py's `windows` section (the torch backend stands in on CPU)."""
    section: dict = {"status": "running", "atol": ATOL_BF16, "results": []}
    report["windows"] = section
    name = "flashinfer" if device == "cuda" else "torch"
    section["results"] = list(rows(device, name, quick=device != "cuda"))
    section["status"] = "ok" if all(r["ok"] for r in section["results"]) else "fail"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, torch standing in")
    args = p.parse_args(argv)
    device, name = ("cpu", "torch") if args.dry_run else ("cuda", "flashinfer")
    ok = True
    for row in rows(device, name):
        ok &= row["ok"]
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": "ok" if ok else "FAILED", "atol": ATOL_BF16}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
