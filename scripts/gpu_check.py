#!/usr/bin/env python
"""One-shot check of radixserve's CUDA path; writes a JSON report.

    python scripts/gpu_check.py --out gpu_check.json

Sections (each a function that fills its key of the report; one failing section does not
stop the others):
  environment      torch / CUDA / GPU / flashinfer versions
  kernels          flashinfer backend vs torch backend on random paged K/V: prefill after a
                   cached prefix, fresh prefill, decode, mixed batch; MHA and GQA (groups 3,
                   4, 7); page sizes 1 and 16; head dims 64 and 128; bf16 and fp16.
                   Max abs errors against each other and against an fp32 dense reference.
  model_greedy     (filled in by the engine owner) greedy output equal between backends
  throughput       (filled in by the engine owner) decode tok/s, shared-prompt benchmark

`--cpu-dry-run` runs the same plumbing on the CPU with the torch backend standing in for
flashinfer (errors are then 0): a check of this script, not of the GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

INSTALL_STEPS = """\
radixserve GPU check. It needs, on a machine with an NVIDIA GPU and the CUDA toolkit:
  pip install -e '.[cuda]'          # radixserve with its CUDA extra (flashinfer-python)
  # or only the kernels:  pip install flashinfer-python
flashinfer JIT-compiles its kernels with nvcc on first use (nvcc must be on PATH or under
$CUDA_HOME); the first run spends minutes compiling, later runs reuse ~/.cache/flashinfer.
"""

# Random-input cases: (cached_len, new_len) per sequence, prefill spans first.
KERNEL_CASES: dict[str, list[tuple[int, int]]] = {
    "prefill_after_cached_prefix": [(37, 50), (128, 17), (5, 300), (1000, 24)],
    "prefill_fresh": [(0, 64), (0, 7), (0, 513)],
    "decode": [(c, 1) for c in (0, 1, 15, 16, 17, 255, 500, 2047)],
    "mixed": [(0, 33), (100, 20), (10, 1), (999, 1), (0, 1), (63, 1)],
}
# (num_qo_heads, num_kv_heads, head_dim): MHA, SmolLM2-135M (group 3, CUDA-core decode),
# Llama-3-8B-like (group 4, tensor-core decode), Qwen2.5-7B-like (group 7).
HEAD_CONFIGS = [(16, 16, 64), (9, 3, 64), (32, 8, 128), (28, 4, 128)]
# bf16 (the CUDA default) for every head config, fp16 for one: each (dtype, head_dim, kernel)
# combination is a separate flashinfer JIT compile, and the check must fit in minutes.
FP16_CONFIGS = [(32, 8, 128)]
PAGE_SIZES = [1, 16]
# |flashinfer - dense| <= ATOL + RTOL * |dense| elementwise (bf16 keeps 8 mantissa bits).
ATOL, RTOL = 1e-2, 2e-2


def check_environment(report: dict) -> None:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
        free, total = torch.cuda.mem_get_info()
        env["gpu_memory_free_gib"] = round(free / 2**30, 1)
        env["gpu_memory_total_gib"] = round(total / 2**30, 1)
    try:
        import flashinfer
        env["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    except Exception as exc:
        env["flashinfer"] = f"unavailable: {type(exc).__name__}: {exc}"
    report["environment"] = env


def _scenario(pool, lens, num_qo_heads, seed, device):
    """Spans with pages scattered over the pool; cached prefixes written into the pool."""
    import numpy as np
    import torch

    from radixserve.attention.metadata import SeqSpan

    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = np.random.default_rng(seed)
    ps, hkv, d = pool.page_size, pool.num_kv_heads, pool.head_dim
    need = [-(-(c + n) // ps) for c, n in lens]
    perm = rng.permutation(pool.num_pages).astype(np.int32)
    spans, fulls, q, k, v, off = [], [], [], [], [], 0
    for (cached, new), npages in zip(lens, need):
        pages = perm[off:off + npages]
        off += npages
        fk, fv = (torch.randn(cached + new, hkv, d, generator=gen) for _ in range(2))
        pos = np.arange(cached)
        slots = torch.from_numpy(pages[pos // ps].astype(np.int64) * ps + pos % ps)
        pool.write(0, slots.to(device), fk[:cached].to(device), fv[:cached].to(device))
        spans.append(SeqSpan(pages, cached, new))
        fulls.append((fk, fv))
        q.append(torch.randn(new, num_qo_heads, d, generator=gen))
        k.append(fk[cached:])
        v.append(fv[cached:])
    cat = lambda xs: torch.cat(xs).to(device=device, dtype=pool.dtype)  # noqa: E731
    return spans, fulls, cat(q), cat(k), cat(v)


def _dense_reference(spans, fulls, q):
    """fp32 SDPA per sequence on contiguous K/V (rounded to the pool dtype, as the kernels
    see them) with a bottom-right causal mask."""
    import torch
    import torch.nn.functional as F

    outs, off = [], 0
    for s, (fk, fv) in zip(spans, fulls):
        qs = q[off:off + s.new_len].float().transpose(0, 1)
        off += s.new_len
        group = qs.shape[0] // fk.shape[1]
        k = fk.to(q.device, q.dtype).float().transpose(0, 1).repeat_interleave(group, 0)
        v = fv.to(q.device, q.dtype).float().transpose(0, 1).repeat_interleave(group, 0)
        kv_len = s.cached_len + s.new_len
        mask = (torch.arange(kv_len, device=q.device)[None, :]
                <= s.cached_len + torch.arange(s.new_len, device=q.device)[:, None])
        outs.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


def _run_backend(backend, pool_args, lens, hq, seed, device):
    """Fresh pool per backend (each writes its own new K/V); returns output and pool."""
    from radixserve.attention.metadata import build_metadata
    from radixserve.cache.kv_pool import KVPool

    pool = KVPool(*pool_args)
    spans, fulls, q, k, v = _scenario(pool, lens, hq, seed, device)
    meta = build_metadata(spans, pool.page_size, device)
    out = backend.forward(backend.prepare(meta), 0, q, k, v, pool)
    return out, pool, spans, fulls, q, meta


def _kernel_case(ref_backend, fi_backend, pool_args, lens, hq, seed, device) -> dict:
    """One random case through both backends and the dense reference."""
    import torch

    t0 = time.perf_counter()
    fi_out, fi_pool, spans, fulls, q, meta = _run_backend(fi_backend, pool_args, lens, hq,
                                                          seed, device)
    if device == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    ref_out, ref_pool, *_ = _run_backend(ref_backend, pool_args, lens, hq, seed, device)
    dense = _dense_reference(spans, fulls, q)
    fi, ref = fi_out.float(), ref_out.float()
    row = {
        "num_prefills": meta.num_prefills, "batch": meta.batch_size, "tokens": meta.num_tokens,
        "max_abs_err_flashinfer_vs_torch": (fi - ref).abs().max().item(),
        "max_abs_err_flashinfer_vs_dense": (fi - dense).abs().max().item(),
        "max_abs_err_torch_vs_dense": (ref - dense).abs().max().item(),
        "within_tolerance": bool(((fi - dense).abs() <= ATOL + RTOL * dense.abs()).all()),
        "kv_written_identically": bool(torch.equal(fi_pool.k[0], ref_pool.k[0])
                                       and torch.equal(fi_pool.v[0], ref_pool.v[0])),
        "finite": bool(torch.isfinite(fi_out).all()),
        "first_call_s": round(first_call_s, 3),   # includes JIT compilation, if any
    }
    row["ok"] = row["finite"] and row["kv_written_identically"] and row["within_tolerance"]
    return row


def check_kernels(report: dict, device: str = "cuda", stand_in: bool = False,
                  quick: bool = False) -> None:
    import torch

    from radixserve.attention.backend import create_backend

    combos = [(torch.bfloat16, c) for c in (HEAD_CONFIGS[:2] if quick else HEAD_CONFIGS)]
    combos += [] if quick else [(torch.float16, c) for c in FP16_CONFIGS]
    results = []
    for dtype, (hq, hkv, d) in combos:
        kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
        ref_backend = create_backend("torch", **kw)
        fi_backend = create_backend("torch" if stand_in else "flashinfer", **kw)
        for ps in PAGE_SIZES:
            for case, lens in KERNEL_CASES.items():
                num_pages = sum(-(-(c + n) // ps) for c, n in lens) + 8
                pool_args = (1, num_pages, ps, hkv, d, dtype, device)
                row = {"case": case, "dtype": str(dtype).removeprefix("torch."),
                       "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "page_size": ps}
                row.update(_kernel_case(ref_backend, fi_backend, pool_args, lens, hq,
                                        seed=len(results), device=device))
                results.append(row)
    report["kernels"] = {
        "status": "ok" if all(r["ok"] for r in results) else "FAILED",
        "stand_in_for_flashinfer": "torch" if stand_in else None,
        "tolerance": {"atol": ATOL, "rtol": RTOL},
        "worst_max_abs_err_vs_dense": max(r["max_abs_err_flashinfer_vs_dense"] for r in results),
        "num_checks": len(results), "failed": [r for r in results if not r["ok"]],
        "results": results,
    }


def check_model_greedy(report: dict) -> None:
    """Greedy output of the default model equal between the torch and flashinfer backends.

    Placeholder: the engine owner fills this in once the engine exists.
    """
    report["model_greedy"] = {"status": "not implemented yet"}


def check_throughput(report: dict) -> None:
    """Decode tok/s at batch 1, 64, 256; shared-system-prompt benchmark, cache on and off.

    Placeholder: the engine owner fills this in once the engine exists.
    """
    report["throughput"] = {"status": "not implemented yet"}


def _run_section(report: dict, name: str, fn: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        fn()
    except Exception as exc:
        report[name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()}
    elapsed = round(time.perf_counter() - t0, 1)
    section = report.get(name)
    if isinstance(section, dict):
        section.setdefault("elapsed_s", elapsed)
        status = section.get("status", "ok")
    else:
        status = "ok"
    print(f"[gpu_check] {name}: {status} ({elapsed} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the report")
    parser.add_argument("--quick", action="store_true", help="fewer kernel configurations")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="exercise this script on CPU with torch standing in for flashinfer")
    args = parser.parse_args(argv)
    print(INSTALL_STEPS, flush=True)

    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; see the install steps above.", file=sys.stderr)
        return 2
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible to torch (torch.cuda.is_available() is "
              "False; torch build: " + torch.__version__ + "). Run this on a machine with an "
              "NVIDIA GPU and a CUDA build of torch; nothing was checked.", file=sys.stderr)
        return 2

    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:]}
    device = "cpu" if dry else "cuda"
    _run_section(report, "environment", lambda: check_environment(report))
    _run_section(report, "kernels",
                 lambda: check_kernels(report, device=device, stand_in=dry, quick=args.quick))
    _run_section(report, "model_greedy", lambda: check_model_greedy(report))
    _run_section(report, "throughput", lambda: check_throughput(report))

    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    kernels = report.get("kernels", {})
    print(f"[gpu_check] kernels: {kernels.get('status')} "
          f"({kernels.get('num_checks', 0)} checks, worst max abs error vs dense "
          f"{kernels.get('worst_max_abs_err_vs_dense')}); report written to {out}")
    return 0 if kernels.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
