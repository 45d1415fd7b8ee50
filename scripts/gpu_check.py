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
  model_greedy     a random-weight model of the default model's shape (SmolLM2-135M, built
                   on the device, scripts/gpu_check_models.py; dtype "auto": bf16 on CUDA)
                   through the Engine: greedy chat replies (32 tokens) with the torch backend
                   and with flashinfer (page size 1, pool sized from free GPU memory; page
                   size 16), compared token by token. A divergence is explained (or not) by
                   teacher-forced logits of both backends on the torch reply.
  fp8_kv           flashinfer over an FP8 KV cache (kv_data_type, k_scale/v_scale) vs the
                   torch backend and dense attention on the decoded K/V; greedy replies
                   with FP8 vs bf16 KV (scripts/gpu_check_fp8.py)
  deterministic    --deterministic: row blocks kept or fallen back per linear shape, and
                   greedy replies one at a time with the cache off vs all at once with the
                   cache on (page size 16, small chunks) identical token for token
                   (scripts/gpu_check_deterministic.py)
  tiers            KV pages demoted to pinned host memory (side CUDA stream with events) and
                   to disk bytes, loaded back: byte-equal (scripts/gpu_check_tiers.py)
  windows          flashinfer with a hybrid model's window pools: two window sizes (64, 32)
                   and a global layer, the windowed layers reading one pool kept at the
                   larger window through a null-mapped page table, against the torch
                   backend in fp32 (scripts/gpu_check_hybrid.py)
  throughput       on a random-weight Llama-3-8B-shaped model (scripts/gpu_check_perf.py):
                   decode at batch 64 and 256 vs the HBM floor, bf16 and fp8 KV; a 4k prefill
                   vs the matmul peak; host-tier load vs recompute per token;
                   scripts/bench_engine.py's shared-system-prompt workload, cache on and off;
                   greedy agreement with the torch backend.

The report is rewritten after every case (a crash keeps what finished). Each section has its
own budget (GPU_SIZES.section_budget_s, 450 s together); `--budget-s` (default 460) bounds
the run: a section, or a part of one, that would start with too little time left is skipped
with a note. `--sections` runs only some sections. `--dry-run` checks the plan (8 minutes,
memory, the 64 MiB a device run may carry) and runs nothing (scripts/gpu_check_plan.py).
`--cpu-dry-run` runs the same plumbing on the CPU at tiny sizes with the torch backend
standing in for flashinfer (errors are then 0): a check of this script, not of the GPU.
Exit status: 0 when every section that was asked for reports "ok", 1 otherwise, 2 when
nothing could run (no CUDA).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

INSTALL_STEPS = """\
radixserve GPU check. It needs, on a machine with an NVIDIA GPU and a CUDA build of torch:
  pip install -e '.[cuda]'          # radixserve with its CUDA extra (flashinfer-python)
  # or only the kernels:  pip install flashinfer-python
  flashinfer download-kernels       # prebuilt kernels matching flashinfer and CUDA, or:
flashinfer JIT-compiles its kernels with nvcc on first use (nvcc must be on PATH or under
$CUDA_HOME); the first run spends minutes compiling, later runs reuse ~/.cache/flashinfer.
On a lent device machine: scripts/gpu_run.sh (docs/gpu.md) installs carried wheels instead.
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
# Unit roundoff (half an ulp at 1) of the dtypes the kernels read and write.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
# The bound below counts each rounding once; kernels round some twice (a split-KV partial
# output and its merge, P in the MMA dtype and again at the end): allow twice the count.
TOLERANCE_SAFETY = 2.0


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


def attention_error_bound(scores, probs, v, out, dtype_name: str):
    """Elementwise bound on |kernel - exact| for o = softmax(s) V, kernels in ``dtype_name``
    with fp32 accumulation; scores [H, n, k] (scaled, -inf masked), probs the exact softmax,
    v [H, k, D], out [H, n, D] the exact output.

    With u the dtype's unit roundoff: (1) a score rounded to the dtype moves exp(s) by a
    factor (1 + u|s|), a probability rounded for the P.V product by (1 + u), so each weight
    p_j carries a relative error e <= u (1 + max_j |s_j|); renormalised by the exact sum,
    |o' - o| <= e * sum_j p_j |v_j - o| <= e * (sum_j p_j |v_j| + |o|). (2) fp32 sums over
    the k keys add at most k * 2^-24 * sum_j p_j |v_j|. (3) Rounding the output adds u |o|.
    So the bound grows with the dtype's u, the output's magnitude (|o|, p.|v|) and the number
    of keys; bf16 128-dim heads (|s| up to ~5) get ~0.03-0.06 where a fixed atol 0.01
    failed by rounding alone (issue 40: 0.013-0.019 on an AVX512-BF16 CPU without AMX).
    """
    import torch

    u = UNIT_ROUNDOFF[dtype_name]
    keys = (probs > 0).sum(-1, keepdim=True)                        # [H, n, 1]
    weight_err = u * (1 + scores.masked_fill(probs == 0, 0).abs().amax(-1, keepdim=True))
    spread = probs @ v.abs()                                         # sum_j p_j |v_j|
    bound = (weight_err * (spread + out.abs()) + keys * 2.0 ** -24 * spread
             + u * out.abs())
    return TOLERANCE_SAFETY * bound


def _dense_reference(spans, fulls, q):
    """fp32 attention per sequence on contiguous K/V (rounded to the pool dtype, as the
    kernels see them) with a bottom-right causal mask; returns (output, error bound)."""
    import torch

    outs, bounds, off = [], [], 0
    dtype_name = str(q.dtype).removeprefix("torch.")
    for s, (fk, fv) in zip(spans, fulls):
        qs = q[off:off + s.new_len].float().transpose(0, 1)
        off += s.new_len
        group = qs.shape[0] // fk.shape[1]
        k = fk.to(q.device, q.dtype).float().transpose(0, 1).repeat_interleave(group, 0)
        v = fv.to(q.device, q.dtype).float().transpose(0, 1).repeat_interleave(group, 0)
        kv_len = s.cached_len + s.new_len
        mask = (torch.arange(kv_len, device=q.device)[None, :]
                <= s.cached_len + torch.arange(s.new_len, device=q.device)[:, None])
        scores = (qs @ k.transpose(1, 2) * qs.shape[-1] ** -0.5).masked_fill(~mask,
                                                                              float("-inf"))
        probs = scores.softmax(-1)
        o = probs @ v
        outs.append(o.transpose(0, 1))
        bounds.append(attention_error_bound(scores, probs, v, o, dtype_name).transpose(0, 1))
    return torch.cat(outs), torch.cat(bounds)


def _run_backend(backend, pool_args, lens, hq, seed, device):
    """Fresh pool per backend (each writes its own new K/V); returns output and pool."""
    from radixserve.attention.metadata import build_metadata
    from radixserve.attention.kv_pool import KVPool

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
    dense, bound = _dense_reference(spans, fulls, q)
    fi, ref = fi_out.float(), ref_out.float()
    row = {
        "num_prefills": meta.num_prefills, "batch": meta.batch_size, "tokens": meta.num_tokens,
        "max_abs_err_flashinfer_vs_torch": (fi - ref).abs().max().item(),
        "max_abs_err_flashinfer_vs_dense": (fi - dense).abs().max().item(),
        "max_abs_err_torch_vs_dense": (ref - dense).abs().max().item(),
        "within_tolerance": bool(((fi - dense).abs() <= bound).all()),
        "torch_within_tolerance": bool(((ref - dense).abs() <= bound).all()),
        "largest_bound": bound.max().item(),
        "kv_written_identically": bool(torch.equal(fi_pool.k[0], ref_pool.k[0])
                                       and torch.equal(fi_pool.v[0], ref_pool.v[0])),
        "finite": bool(torch.isfinite(fi_out).all()),
        "first_call_s": round(first_call_s, 3),   # includes JIT compilation, if any
    }
    row["ok"] = row["finite"] and row["kv_written_identically"] and row["within_tolerance"]
    return row


class LiveReport(dict):
    """The report, written to its file again after every case (``flush``): a kernel that
    crashes the process or a run stopped at its time limit keeps what finished before."""

    def __init__(self, path: Path | None = None, **fields):
        super().__init__(**fields)
        self.path = path

    def flush(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps(self, indent=2, default=str) + "\n")
            tmp.replace(self.path)


def flush(report: dict) -> None:
    """Write ``report`` out now when it is a LiveReport (tests pass plain dicts)."""
    if isinstance(report, LiveReport):
        report.flush()


def check_kernels(report: dict, device: str = "cuda", stand_in: bool = False,
                  quick: bool = False, time_left: Callable[[], float] | None = None) -> None:
    """`time_left`: seconds this section may still start new configurations in (each one
    JIT-compiles its kernels on first use); the rest are listed as skipped. Each case is in
    the report as soon as it finishes; per configuration, ``compile_s`` is its first case's
    cold time minus the same case run again warm (flashinfer's JIT build and load)."""
    import torch

    from radixserve.attention.backend import create_backend

    combos = [(torch.bfloat16, c) for c in (HEAD_CONFIGS[:2] if quick else HEAD_CONFIGS)]
    combos += [] if quick else [(torch.float16, c) for c in FP16_CONFIGS]
    results: list[dict] = []
    section = report["kernels"] = {
        "status": "running", "stand_in_for_flashinfer": "torch" if stand_in else None,
        "tolerance": "attention_error_bound: from the dtype, |output| and the keys summed",
        "num_checks": 0, "failed": [], "skipped_for_time_budget": [], "compile_s": {},
        "results": results}
    for dtype, (hq, hkv, d) in combos:
        dtype_name = str(dtype).removeprefix("torch.")
        if time_left is not None and time_left() <= 0:
            section["skipped_for_time_budget"].append(
                {"dtype": dtype_name, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d})
            continue
        kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
        ref_backend = create_backend("torch", **kw)
        fi_backend = create_backend("torch" if stand_in else "flashinfer", **kw)
        for ps in PAGE_SIZES:
            for case, lens in KERNEL_CASES.items():
                num_pages = sum(-(-(c + n) // ps) for c, n in lens) + 8
                pool_args = (1, num_pages, ps, hkv, d, dtype, device)
                row = {"case": case, "dtype": dtype_name,
                       "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "page_size": ps}
                try:
                    row.update(_kernel_case(ref_backend, fi_backend, pool_args, lens, hq,
                                            seed=len(results), device=device))
                except Exception as exc:      # recorded; the next case still runs
                    row.update(_error(exc), ok=False)
                results.append(row)
                key = f"{dtype_name}/{hq}x{hkv}x{d}/page{ps}"
                if not stand_in and key not in section["compile_s"] and "first_call_s" in row:
                    warm = _kernel_case(ref_backend, fi_backend, pool_args, lens, hq,
                                        seed=len(results) - 1, device=device)
                    section["compile_s"][key] = round(max(
                        0.0, row["first_call_s"] - warm["first_call_s"]), 2)
                section["num_checks"] = len(results)
                section["failed"] = [r for r in results if not r["ok"]]
                section["worst_max_abs_err_vs_dense"] = max(
                    (r["max_abs_err_flashinfer_vs_dense"] for r in results
                     if "max_abs_err_flashinfer_vs_dense" in r), default=None)
                flush(report)
    status = "ok" if all(r["ok"] for r in results) else "FAILED"
    section["status"] = ("incomplete" if status == "ok" and section["skipped_for_time_budget"]
                         else status)
    flush(report)


# ---- model and throughput sections -------------------------------------------------------

DEFAULT_BUDGET_S = 460.0    # the whole check must end within 8 minutes on one H100/H200
RUN_LIMIT_S = 480.0         # 8 minutes: what one prepared device run may take
START_OVERHEAD_S = 20.0     # wheel install, imports, the environment section
SEND_LIMIT_BYTES = 64 * 2**20       # what a device run may carry (tree + .whl/)
FLASHINFER_WHEEL_MAX_BYTES = 20 * 10**6
WHEELS_MAX_BYTES = 25 * 10**6       # all of scripts/gpu_wheels.txt (21.6 MB when written)
WORKSPACE_ESTIMATE_BYTES = 4 * 2**30      # activations, flashinfer workspaces, allocator slack
# The one command for a lent GPU (the device tool's run), as docs/gpu.md gives it.
DEVICE_COMMAND = {"command": "bash scripts/gpu_run.sh", "carry": [".whl"], "timeout_s": 540}

GREEDY_SYSTEM = "You are a concise, helpful assistant."
GREEDY_QUESTIONS = [
    "What is the capital of France, and what river flows through it?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers greater than 100.",
]
# A greedy divergence between backends is "explained" when the reference's top-2 logit
# margin at that token is within what the two backends' logits differ by anyway:
# |l1 - l2| <= |dl1| + |dl2| <= 2 * max |dl|.
NEAR_TIE_FACTOR = 2.0


class Sizes(NamedTuple):
    """Workload sizes: the real ones on a GPU, tiny ones for the CPU dry run."""

    model_dtype: str                     # "auto" -> bf16 on CUDA (sm80+)
    greedy_questions: int
    greedy_tokens: int
    engine_kv_tokens: int                # pool of the engines with an explicit size
    decode_batches: tuple[int, ...]
    decode_context: int                  # prompt tokens per sequence before decoding
    decode_warmup: int
    decode_steps: int
    prefill_chunk_tokens: int            # tokens per prefill step of the decode benchmark
    shared: dict                         # scripts/bench_engine.py arguments
    section_min_s: dict                  # skip a section with less budget than this left
    item_min_s: float                    # ... and a benchmark inside one
    section_budget_s: dict               # each section's own time (JIT compiles included)
    prefill_tokens: int                  # the prefill-vs-peak chunk
    bandwidth_probe_bytes: int           # the copy that measures HBM bandwidth
    matmul_probe_n: int                  # the n^3 matmul that measures the peak


GPU_SIZES = Sizes(
    model_dtype="auto", greedy_questions=4, greedy_tokens=32, engine_kv_tokens=65536,
    decode_batches=(64, 256), decode_context=512, decode_warmup=4, decode_steps=32,
    prefill_chunk_tokens=8192,
    shared=dict(groups=8, per_group=8, system=1024, question=64, output=32,
                chunked_prefill_size=2048, kv_cache_tokens=131072),
    section_min_s={"kernels": 60.0, "model_greedy": 30.0, "fp8_kv": 30.0,
                   "deterministic": 30.0, "throughput": 60.0, "tiers": 10.0,
                   "windows": 5.0},
    item_min_s=10.0,
    # 450 s together; with START_OVERHEAD_S the run fits in 8 minutes (checked by --dry-run)
    section_budget_s={"kernels": 130.0, "model_greedy": 50.0, "fp8_kv": 60.0,
                      "deterministic": 60.0, "throughput": 120.0, "tiers": 20.0,
                      "windows": 10.0},
    prefill_tokens=4096, bandwidth_probe_bytes=2**30, matmul_probe_n=8192)
CPU_DRY_SIZES = Sizes(
    model_dtype="float32", greedy_questions=2, greedy_tokens=4, engine_kv_tokens=4096,
    decode_batches=(1, 4), decode_context=16, decode_warmup=1, decode_steps=3,
    prefill_chunk_tokens=256,
    shared=dict(groups=2, per_group=2, system=64, question=8, output=4,
                chunked_prefill_size=2048, kv_cache_tokens=4096),
    section_min_s={"kernels": 0.0, "model_greedy": 0.0, "fp8_kv": 0.0, "deterministic": 0.0,
                   "throughput": 0.0, "tiers": 0.0, "windows": 0.0},
    item_min_s=0.0,
    section_budget_s={"kernels": 1e9, "model_greedy": 1e9, "fp8_kv": 1e9,
                      "deterministic": 1e9, "throughput": 1e9, "tiers": 1e9,
                      "windows": 1e9},
    prefill_tokens=64, bandwidth_probe_bytes=2**24, matmul_probe_n=256)


class Budget:
    """Seconds left of --budget-s, counted from the start of the run."""

    def __init__(self, total_s: float):
        self.total_s = total_s
        self.started = time.perf_counter()

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.started)

    def skip_note(self, needed_s: float) -> str | None:
        """None when `needed_s` still fits, else why the work is skipped."""
        left = self.left()
        if left > needed_s:
            return None
        return (f"skipped: {max(left, 0):.0f} s of the {self.total_s:.0f} s budget left, "
                f"this needs about {needed_s:.0f} s (raise --budget-s)")


class CheckContext:
    """What the model sections share, passed explicitly: where they run, at what sizes,
    the time budget (the running section's), and the random-weight models (built on first
    use, then reused).

    (Plain classes, not dataclasses, here: tests load this script with importlib without
    registering it in sys.modules, where dataclass() cannot resolve string annotations.)
    """

    def __init__(self, device: str, dry_run: bool, sizes: Sizes, budget: Budget):
        self.device = device
        self.dry_run = dry_run
        self.sizes = sizes
        self.budget = budget
        self.loaded: Any = None
        self.model_info: dict = {}
        self.big: Any = None
        self.big_info: dict = {}
        self.report: dict | None = None      # the LiveReport, for flushes inside sections

    @property
    def backend_under_test(self) -> str:
        """flashinfer; on a dry run the torch backend stands in for it."""
        return "torch" if self.dry_run else "flashinfer"

    def model(self):
        """The default model's shape (SmolLM2-135M), seeded random weights on the device."""
        if self.loaded is None:
            models = _import_script("gpu_check_models")
            shape = models.SMOLLM2_135M_DRY if self.dry_run else models.SMOLLM2_135M
            self.loaded, self.model_info = models.random_model(
                "smollm2-135m-shaped", shape, self.dtype(), self.device)
        return self.loaded

    def big_model(self):
        """Llama-3-8B's shape (a shrunk one on the CPU dry run), for throughput."""
        if self.big is None:
            models = _import_script("gpu_check_models")
            shape = models.LLAMA3_8B_DRY if self.dry_run else models.LLAMA3_8B
            self.big, self.big_info = models.random_model(
                "llama3-8b-shaped", shape, self.dtype(), self.device, seed=1)
        return self.big

    def dtype(self):
        from radixserve.model.dtype import resolve_device, resolve_dtype

        return resolve_dtype(self.sizes.model_dtype, resolve_device(self.device))


def _error(exc: BaseException) -> dict:
    """A failure as the report records it (call inside the except block)."""
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _release_memory() -> None:
    """Drop a finished engine's KV pool before the next one sizes itself."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _import_script(name: str):
    """A sibling script as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_radixserve_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def greedy_tokens(engine, prompt: list[int], params) -> list[int]:
    """Every token of one request's reply, streamed from ``engine``."""
    tokens = []
    async for out in engine.generate(prompt, params):
        tokens += out.token_ids
    return tokens


def _greedy_run(loaded, prompts: list[list[int]], max_tokens: int, **config) -> dict:
    """The prompts through an Engine; greedy, exactly max_tokens tokens each."""
    import asyncio

    from radixserve.engine.config import EngineConfig
    from radixserve.engine.engine import Engine
    from radixserve.engine.runner import cuda_free_bytes
    from radixserve.engine.sampling_params import SamplingParams

    cfg = EngineConfig(**config)
    on_cuda = loaded.device.type == "cuda"
    free_before = cuda_free_bytes(loaded.device) if on_cuda else None
    engine = Engine(cfg, loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt):
        return await greedy_tokens(engine, prompt, params)

    async def run():
        await engine.start()
        try:
            # The first prompt alone, then the rest together: they reuse its system prompt
            # from the radix cache (prefill over a cached prefix; copy-on-write when paged).
            first = await one(prompts[0])
            outputs = [first, *await asyncio.gather(*(one(p) for p in prompts[1:]))]
            engine.check_invariants()
            return outputs
        finally:
            await engine.shutdown()

    t0 = time.perf_counter()
    outputs = asyncio.run(run())
    stats = engine.stats()
    result = {
        "attention_backend": engine.runner.backend.name, "page_size": cfg.page_size,
        "kv_pool_pages": engine.runner.num_pages,
        "kv_pool_gib": round(stats.kv_pool_bytes / 2**30, 3),
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "token_ids": outputs, "text": [loaded.tokenizer.decode(t) for t in outputs],
    }
    if cfg.kv_cache_tokens is None and free_before is not None:
        share = stats.kv_pool_bytes / free_before
        # Whole pages below the budget: the share sits just under the fraction.
        result["pool_sizing"] = {
            "kv_cache_memory_fraction": cfg.kv_cache_memory_fraction,
            "free_gib_before": round(free_before / 2**30, 2),
            "pool_share_of_free": round(share, 4),
            "ok": cfg.kv_cache_memory_fraction - 0.01 <= share <= cfg.kv_cache_memory_fraction}
    del engine
    _release_memory()
    return result


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class TeacherForced:
    """Logits at every position of a fixed token sequence, from one prefill per backend,
    so two backends are compared on the same inputs whatever they generated."""

    def __init__(self, loaded, max_tokens: int):
        self.loaded = loaded
        self.max_tokens = max_tokens
        self._runners: dict[str, Any] = {}
        self._memo: dict[tuple, Any] = {}     # both flashinfer runs compare the same sequences

    def _runner(self, backend: str):
        from radixserve.engine.config import EngineConfig
        from radixserve.engine.runner import ModelRunner

        if backend not in self._runners:
            cfg = EngineConfig(attention_backend=backend, kv_cache_tokens=self.max_tokens)
            self._runners[backend] = ModelRunner(cfg, self.loaded)
        return self._runners[backend]

    def logits(self, backend: str, tokens: list[int]):
        """float32 [len(tokens), vocab]: row i predicts token i + 1."""
        import numpy as np
        import torch

        from radixserve.attention.context import ForwardContext
        from radixserve.attention.metadata import SeqSpan, build_metadata

        key = (backend, tuple(tokens))
        if key not in self._memo:
            runner = self._runner(backend)
            n = len(tokens)
            meta = build_metadata([SeqSpan(np.arange(n, dtype=np.int32), 0, n)], 1,
                                  runner.device)
            with torch.inference_mode():
                ctx = ForwardContext.prepare(runner.backend, meta, runner.kv_pool)
                ids = torch.tensor(tokens, dtype=torch.long, device=runner.device)
                rows = torch.arange(n, device=runner.device)
                self._memo[key] = runner.model(ids, rows, ctx, rows)
        return self._memo[key]

    def compare(self, ref: str, other: str, prompt: list[int], reply: list[int],
                divergence: int | None) -> dict:
        """Max |logit difference| and top-1 agreement over the reply's positions; at a
        divergence, the reference's top-2 margin there and whether the difference explains it."""
        tokens = prompt + reply
        a, b = self.logits(ref, tokens), self.logits(other, tokens)
        gen = slice(len(prompt) - 1, len(tokens) - 1)   # rows predicting reply tokens
        diff = (a[gen] - b[gen]).abs().max().item()
        row = {"max_abs_logit_diff": round(diff, 4),
               "top1_agreement": round((a[gen].argmax(-1) == b[gen].argmax(-1))
                                       .float().mean().item(), 4)}
        if divergence is not None and divergence < len(reply):
            top2 = a[len(prompt) - 1 + divergence].topk(2).values
            margin = (top2[0] - top2[1]).item()
            row["ref_top2_margin_at_divergence"] = round(margin, 4)
            row["explained_by_near_tie"] = margin <= NEAR_TIE_FACTOR * diff
        elif divergence is not None:
            row["explained_by_near_tie"] = False     # lengths differ: not a numeric flip
        return row


def check_model_greedy(report: dict, ctx: CheckContext) -> None:
    """Greedy output of the default model through the Engine: torch vs flashinfer."""
    loaded = ctx.model()
    sz = ctx.sizes
    prompts = [loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": GREEDY_SYSTEM}, {"role": "user", "content": q}])
        for q in GREEDY_QUESTIONS[:sz.greedy_questions]]
    fi = ctx.backend_under_test
    # The flashinfer page-size-1 run sizes its pool from free GPU memory (the default).
    runs = {
        "torch": dict(attention_backend="torch", kv_cache_tokens=sz.engine_kv_tokens),
        "flashinfer": dict(attention_backend=fi,
                           kv_cache_tokens=sz.engine_kv_tokens if ctx.dry_run else None),
        "flashinfer_page16": dict(attention_backend=fi, page_size=16,
                                  kv_cache_tokens=sz.engine_kv_tokens),
    }
    section: dict = {"status": "running", "model": ctx.model_info,
                     "stand_in_for_flashinfer": "torch" if ctx.dry_run else None,
                     "prompts": GREEDY_QUESTIONS[:sz.greedy_questions],
                     "max_tokens": sz.greedy_tokens, "runs": {}, "comparisons": {}}
    report["model_greedy"] = section
    failed_runs = []
    for name, config in runs.items():
        try:
            section["runs"][name] = _greedy_run(loaded, prompts, sz.greedy_tokens, **config)
        except Exception as exc:        # the other runs still go ahead
            section["runs"][name] = _error(exc)
            failed_runs.append(name)
            _release_memory()
    if "torch" in failed_runs:
        section["status"] = "error"     # no reference to compare with
        return

    ref = section["runs"]["torch"]["token_ids"]
    teacher = TeacherForced(loaded, max(map(len, prompts)) + sz.greedy_tokens)
    problems = []
    for name in ("flashinfer", "flashinfer_page16"):
        run = section["runs"][name]
        if name in failed_runs:
            continue
        if run["attention_backend"] != fi:
            problems.append(f"{name} ran on the {run['attention_backend']} backend")
        rows = []
        for i, (want, got) in enumerate(zip(ref, run["token_ids"])):
            div = first_divergence(want, got)
            row = {"prompt": i, "identical": div is None, "first_divergence": div}
            row.update(teacher.compare("torch", fi, prompts[i], want, div))
            rows.append(row)
            if div is not None and not row["explained_by_near_tie"]:
                margin = row.get("ref_top2_margin_at_divergence")
                problems.append(f"{name} prompt {i} diverges at token {div} where the torch "
                                f"backend's top-2 margin ({margin}) exceeds "
                                f"{NEAR_TIE_FACTOR} x the logit difference")
        section["comparisons"][name] = {"all_identical": all(r["identical"] for r in rows),
                                        "per_prompt": rows}
    sizing = section["runs"]["flashinfer"].get("pool_sizing")
    if sizing is not None and not sizing["ok"]:
        problems.append(f"pool sized to {sizing['pool_share_of_free']} of free memory, "
                        f"wanted just under {sizing['kv_cache_memory_fraction']}")
    section["all_identical"] = all(c["all_identical"] for c in section["comparisons"].values())
    section["problems"] = problems
    section["status"] = "error" if failed_runs else "FAILED" if problems else "ok"


def _decode_run(runner, batch: int, sz: Sizes, seed: int) -> dict:
    """Prefill `batch` random prompts, then time greedy decode steps of the whole batch."""
    import numpy as np

    from radixserve.attention.metadata import SeqSpan
    from radixserve.engine.batch import StepBatch
    from radixserve.engine.sampling_params import SamplingParams

    ctx_len, total = sz.decode_context, sz.decode_warmup + sz.decode_steps
    span = ctx_len + total                    # page_size 1: one page per token
    prompts = np.random.default_rng(seed).integers(200, 48000, size=(batch, ctx_len)).tolist()
    pages = [np.arange(i * span, (i + 1) * span, dtype=np.int32) for i in range(batch)]
    greedy = SamplingParams(max_tokens=total + 1, temperature=0.0)

    def step_batch(rows, input_ids, positions, spans) -> StepBatch:
        return StepBatch(input_ids=input_ids, positions=positions, spans=spans,
                         sample_rows=list(range(len(rows))),
                         sample_params=[greedy] * len(rows), generators=[None] * len(rows))

    per_step = max(1, sz.prefill_chunk_tokens // ctx_len)
    last: list[int] = []
    t0 = time.perf_counter()
    for start in range(0, batch, per_step):
        rows = range(start, min(batch, start + per_step))
        last += runner.execute(step_batch(
            rows, [t for i in rows for t in prompts[i]], list(range(ctx_len)) * len(rows),
            [SeqSpan(pages[i], 0, ctx_len) for i in rows])).sample.token_ids
    prefill_s = time.perf_counter() - t0

    def decode(k: int) -> list[int]:     # k tokens decoded before this step
        rows = range(batch)
        return runner.execute(step_batch(
            rows, last, [ctx_len + k] * batch,
            [SeqSpan(pages[i], ctx_len + k, 1) for i in rows])).sample.token_ids

    for k in range(sz.decode_warmup):
        last = decode(k)
    t0 = time.perf_counter()
    for k in range(sz.decode_warmup, total):
        last = decode(k)                  # .tolist() in the sampler: one sync per step
    elapsed = time.perf_counter() - t0
    return {"batch": batch, "context_tokens": ctx_len, "timed_steps": sz.decode_steps,
            "decode_tokens_per_s": round(batch * sz.decode_steps / elapsed, 1),
            "ms_per_step": round(elapsed / sz.decode_steps * 1e3, 3),
            "prefill_tokens_per_s": round(batch * ctx_len / prefill_s, 1)}


def _decode_throughput(ctx: CheckContext, loaded) -> dict:
    """Decode vs the HBM floor, bf16 KV (scripts/gpu_check_perf.py)."""
    perf = _import_script("gpu_check_perf")
    out = perf.decode_vs_floor(sys.modules[__name__], ctx, loaded, "auto")
    out["method"] = ("ModelRunner.execute on hand-built StepBatches: metadata, backend plan, "
                     "model forward and greedy sampling (one host sync per step); no "
                     "scheduler, no asyncio")
    return out


def _fp8_decode(ctx: CheckContext, loaded) -> dict:
    perf = _import_script("gpu_check_perf")
    return perf.decode_vs_floor(sys.modules[__name__], ctx, loaded, "fp8_e4m3")


def _prefill(ctx: CheckContext, loaded) -> dict:
    perf = _import_script("gpu_check_perf")
    return perf.prefill_vs_peak(sys.modules[__name__], ctx, loaded)


def _backend_agreement(ctx: CheckContext, loaded) -> dict:
    """Greedy tokens of the 8B-shaped model: torch vs the backend under test, same weights."""
    prompts = [loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": GREEDY_SYSTEM}, {"role": "user", "content": q}])
        for q in GREEDY_QUESTIONS[:2]]
    n = ctx.sizes.greedy_tokens
    runs = {name: _greedy_run(loaded, prompts, n, attention_backend=name,
                              kv_cache_tokens=ctx.sizes.engine_kv_tokens)
            for name in ("torch", ctx.backend_under_test)}
    ref, got = runs["torch"]["token_ids"], runs[ctx.backend_under_test]["token_ids"]
    return {"status": "ok", "attention_backend": runs[ctx.backend_under_test]["attention_backend"],
            "first_divergence": [first_divergence(a, b) for a, b in zip(ref, got)],
            "identical": sum(a == b for a, b in zip(ref, got)), "prompts": len(prompts)}


def _auto_backend_name(loaded) -> str:
    """What --attention-backend auto picks for this model here (bench_engine uses auto)."""
    from radixserve.attention.backend import create_backend

    mc = loaded.config
    return create_backend("auto", num_qo_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                          head_dim=mc.head_dim, dtype=loaded.dtype, device=loaded.device).name


def _shared_prompt(ctx: CheckContext, loaded) -> dict:
    """scripts/bench_engine.py's workload and engine driver, cache on and off."""
    import asyncio

    from radixserve.engine.config import DEFAULT_MODEL

    bench = _import_script("bench_engine")
    args = argparse.Namespace(model=DEFAULT_MODEL, dtype=_dtype_name(loaded.dtype), seed=0,
                              **ctx.sizes.shared)
    prompts = bench.make_prompts(args)
    n_prompt = sum(map(len, prompts))
    out: dict = {"workload": {**ctx.sizes.shared, "requests": len(prompts),
                              "prompt_tokens": n_prompt, "shuffled": True},
                 "attention_backend": _auto_backend_name(loaded), "runs": {}}
    outputs = {}
    for label, disable in (("cache_on", False), ("cache_off", True)):
        note = ctx.budget.skip_note(ctx.sizes.item_min_s)
        if note:
            out["runs"][label] = {"status": "skipped", "note": note}
            continue
        try:
            r = asyncio.run(bench.run_engine(loaded, prompts, args, disable_cache=disable))
        except Exception as exc:
            out["runs"][label] = _error(exc)
            continue
        finally:
            _release_memory()
        outputs[label] = r["outputs"]
        out["runs"][label] = {
            "status": "ok", "wall_s": round(r["wall"], 3),
            "output_tokens_per_s": round(len(prompts) * args.output / r["wall"], 1),
            "ttft_p50_s": round(statistics.median(r["ttft"]), 4),
            "ttft_p90_s": round(bench.pct(r["ttft"], 0.9), 4),
            "cached_prompt_share": round(r["cached"] / n_prompt, 4),
            "steps": r["steps"], "scheduler_ms_per_step": round(r["sched_ms"], 3)}
    on, off = out["runs"].get("cache_on", {}), out["runs"].get("cache_off", {})
    if on.get("status") == "ok" and off.get("status") == "ok":
        out["cache_on_speedup_wall"] = round(off["wall_s"] / on["wall_s"], 2)
        out["cache_on_speedup_ttft_p50"] = round(off["ttft_p50_s"] / on["ttft_p50_s"], 2)
        out["greedy_identical_on_vs_off"] = sum(
            a == b for a, b in zip(outputs["cache_on"], outputs["cache_off"]))
    return out


def check_throughput(report: dict, ctx: CheckContext) -> None:
    """On the Llama-3-8B-shaped model: decode vs the HBM floor (bf16 and fp8 KV), a 4k
    prefill vs the matmul peak with host-tier load vs recompute, the shared-system-prompt
    workload cache on vs off, and greedy agreement with the torch backend."""
    loaded = ctx.big_model()
    section: dict = {"status": "running", "model": ctx.big_info,
                     "stand_in_for_flashinfer": "torch" if ctx.dry_run else None}
    report["throughput"] = section
    parts = {"decode": lambda: _decode_throughput(ctx, loaded),
             "decode_fp8_kv": lambda: _fp8_decode(ctx, loaded),
             "prefill": lambda: _prefill(ctx, loaded),
             "shared_system_prompt": lambda: _shared_prompt(ctx, loaded),
             "agreement_with_torch": lambda: _backend_agreement(ctx, loaded)}
    for name, fn in parts.items():
        note = ctx.budget.skip_note(ctx.sizes.item_min_s)
        if note:
            section[name] = {"status": "skipped", "note": note}
            continue
        try:
            section[name] = fn()
        except Exception as exc:      # one part failing leaves the others to run
            section[name] = _error(exc)
            _release_memory()
        flush(report)
    if isinstance(section.get("decode_fp8_kv"), dict) and isinstance(section.get("decode"), dict):
        perf = _import_script("gpu_check_perf")
        section["fp8_over_bf16_kv"] = perf.fp8_vs_bf16(section["decode"],
                                                       section["decode_fp8_kv"])
    items = []
    for name in parts:
        part = section[name]
        items += part.get("results") or list(part.get("runs", {}).values()) or [part]
    statuses = {item.get("status", "ok") for item in items}
    section["status"] = ("error" if "error" in statuses
                         else "incomplete" if "skipped" in statuses else "ok")


# ---- driver ------------------------------------------------------------------------------

SECTIONS = ("kernels", "model_greedy", "fp8_kv", "deterministic", "throughput", "tiers",
            "windows")


def _run_section(report: dict, name: str, fn: Callable[[], None],
                 skip_note: str | None = None) -> None:
    t0 = time.perf_counter()
    if skip_note is not None:
        report[name] = {"status": "skipped", "note": skip_note}
        print(f"[gpu_check] {name}: {skip_note}", flush=True)
        return
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        fn()
    except Exception as exc:        # keep what the section recorded before it failed
        partial = report.get(name) if isinstance(report.get(name), dict) else {}
        report[name] = {**partial, **_error(exc)}
    elapsed = round(time.perf_counter() - t0, 1)
    section = report.get(name)
    if isinstance(section, dict):
        section.setdefault("elapsed_s", elapsed)
        status = section.get("status", "ok")
    else:
        status = "ok"
    print(f"[gpu_check] {name}: {status} ({elapsed} s)", flush=True)


def _summary(report: dict, sections: list[str]) -> list[str]:
    lines = []
    k = report.get("kernels", {})
    if "kernels" in sections:
        lines.append(f"kernels: {k.get('status')} ({k.get('num_checks', 0)} checks, worst max "
                     f"abs error vs dense {k.get('worst_max_abs_err_vs_dense')})")
    g = report.get("model_greedy", {})
    if "model_greedy" in sections:
        detail = g.get("error") or g.get("note") or "; ".join(g.get("problems", []))
        lines.append(f"model_greedy: {g.get('status')} (outputs identical across backends: "
                     f"{g.get('all_identical')}{'; ' + detail if detail else ''})")
    f = report.get("fp8_kv", {})
    if "fp8_kv" in sections:
        lines.append(f"fp8_kv: {f.get('status')} ({f.get('num_checks', 0)} checks; greedy "
                     f"tokens until divergence fp8 vs bf16 KV "
                     f"{f.get('greedy', {}).get('tokens_until_divergence_fp8_vs_bf16_kv')})")
    d = report.get("deterministic", {})
    if "deterministic" in sections:
        lines.append(f"deterministic: {d.get('status')} (identical alone/cache off vs "
                     f"batched/cache on: {d.get('identical_deterministic')}; default mode "
                     f"{d.get('identical_default_mode')})")
    t = report.get("throughput", {})
    if "throughput" in sections:
        decode = ", ".join(f"b{r['batch']} {r.get('decode_tokens_per_s', r.get('status'))} "
                           f"(floor/measured {r.get('floor_over_measured')})"
                           for r in t.get("decode", {}).get("results", []))
        shared = t.get("shared_system_prompt", {})
        prefill = t.get("prefill", {})
        fp8 = ", ".join(f"b{r['batch']} {r['fp8_over_bf16']}"
                        for r in t.get("fp8_over_bf16_kv", []))
        lines.append(f"throughput: {t.get('status')} (decode tok/s {decode or '-'}; prefill "
                     f"{prefill.get('tokens')} tokens at {prefill.get('share_of_peak')} of the "
                     f"matmul peak; host-tier recompute/load per token "
                     f"{prefill.get('host_tier', {}).get('recompute_over_load')}; fp8/bf16 KV "
                     f"ms per step {fp8 or '-'}; shared prompt cache on vs off "
                     f"{shared.get('cache_on_speedup_wall')}x wall, "
                     f"{shared.get('cache_on_speedup_ttft_p50')}x TTFT p50)")
    tiers = report.get("tiers", {})
    if "tiers" in sections:
        res = tiers.get("results", [])
        lines.append(f"tiers: {tiers.get('status')} ({sum(r['bytes_equal'] for r in res)} of "
                     f"{len(res)} cases byte-equal after host/disk round trips; side stream "
                     f"{all(r['side_stream'] for r in res) if res else '-'})")
    if "windows" in sections:
        w = report.get("windows", {})
        res = w.get("results", [])
        worst = max((r["max_abs_err_vs_torch_fp32"] for r in res), default=None)
        lines.append(f"windows: {w.get('status')} ({sum(r['ok'] for r in res)} of {len(res)} "
                     f"layer cases within {w.get('atol')}; largest error {worst})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the report")
    parser.add_argument("--quick", action="store_true", help="fewer kernel configurations")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="exercise this script on CPU with torch standing in for flashinfer")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the plan of the GPU run (budgets, sizes, what it sends) "
                             "and write it to --out; runs nothing")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="time budget: sections that would start too late are skipped")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.dry_run:
        return _import_script("gpu_check_plan").main_dry_run(
            sys.modules[__name__], sections, args.quick, args.budget_s, Path(args.out))
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

    budget = Budget(args.budget_s)
    device = "cpu" if dry else "cuda"
    ctx = CheckContext(device=device, dry_run=dry, sizes=CPU_DRY_SIZES if dry else GPU_SIZES,
                       budget=budget)
    report = LiveReport(Path(args.out), started=time.strftime("%Y-%m-%dT%H:%M:%S"),
                        argv=sys.argv[1:], mode="cpu-dry-run" if dry else "cuda",
                        budget_s=args.budget_s, sections=sections)
    ctx.report = report
    min_s = ctx.sizes.section_min_s
    runners = {
        "kernels": lambda: check_kernels(report, device=device, stand_in=dry, quick=args.quick,
                                         time_left=ctx.budget.left),
        "model_greedy": lambda: check_model_greedy(report, ctx),
        "fp8_kv": lambda: _import_script("gpu_check_fp8").check_fp8_kv(
            report, sys.modules[__name__], ctx, quick=args.quick),
        "deterministic": lambda: _import_script("gpu_check_deterministic").check_deterministic(
            report, sys.modules[__name__], ctx),
        "throughput": lambda: check_throughput(report, ctx),
        "tiers": lambda: _import_script("gpu_check_tiers").check_tiers(report, device),
        "windows": lambda: _import_script("gpu_check_hybrid").check_windows(report, device),
    }
    _run_section(report, "environment", lambda: check_environment(report))
    for name in sections:
        # Each section runs on its own budget, cut to what the whole run has left.
        ctx.budget = Budget(min(ctx.sizes.section_budget_s[name], budget.left()))
        _run_section(report, name, runners[name], budget.skip_note(min_s[name]))
        report.flush()
    report["elapsed_s"] = round(time.perf_counter() - budget.started, 1)
    report.flush()
    for line in _summary(report, sections):
        print(f"[gpu_check] {line}")
    print(f"[gpu_check] {report['elapsed_s']} s; report written to {report.path}")
    return 0 if all(report[name].get("status") == "ok" for name in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
