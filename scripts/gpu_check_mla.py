"""The flashinfer MLA path on a lent GPU: FlashInferMLABackend (absorbed, over LatentKVPool
pages) against the torch MLA backend on the same pages, then decode timing.

DeepSeek-V2-Lite's attention shapes (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128),
bf16, random weights and latents from one seed, one layer. Cases: a mixed step (fresh
prefill, prefill continuing a cached prefix, decodes) at page sizes 1 and 16; then one
decode step at batch 32 and 128 with 2,048 cached tokens, both backends timed with CUDA
events. The report (JSON) is rewritten after every case, so a run cut short keeps what ran.

    GPU_CHECK=gpu_check_mla.py bash scripts/gpu_run.sh      # on the device (docs/gpu.md)
    PYTHONPATH=. python scripts/gpu_check_mla.py --dry-run   # CPU: torch vs itself, tiny
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.attention.mla_torch import MLATorchBackend
from radixserve.attention.mla_weights import LatentProjections

FULL = dict(heads=16, r=512, rope=64, nope=128, v=128)
DRY = dict(heads=4, r=32, rope=8, nope=16, v=12)
MIXED = [(0, 37), (100, 19), (64, 1), (5, 1), (250, 1)]      # (cached, new) per sequence


def make_step(c: dict, lens, page_size: int, dtype, device, seed: int = 0):
    """(proj, pool, meta, inputs) with every cached prefix already in the pool."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    proj = LatentProjections(c["heads"], c["nope"], c["v"], c["r"], (c["nope"] + c["rope"]) ** -0.5)
    proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * 0.05)
    proj.to(device=device, dtype=dtype)
    per_seq = [-(-(a + b) // page_size) for a, b in lens]
    pool = LatentKVPool(1, sum(per_seq), page_size, c["r"], c["rope"], dtype, device)
    for t in pool.page_tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    pages = np.random.default_rng(seed).permutation(sum(per_seq)).astype(np.int32)
    bounds = np.cumsum([0] + per_seq)
    spans = [SeqSpan(pages[bounds[i]:bounds[i + 1]], a, b) for i, (a, b) in enumerate(lens)]
    meta = build_metadata(spans, page_size, device)
    t = meta.num_tokens
    inputs = (rnd(t, c["heads"], c["nope"]), rnd(t, c["heads"], c["rope"]), rnd(t, c["r"]),
              rnd(t, c["rope"]))
    return proj, pool, meta, inputs


def run_once(backend, step):
    proj, pool, meta, inputs = step
    return backend.forward_latent(backend.prepare(meta), 0, *inputs, proj, pool)


def timed_ms(fn, device, repeats: int = 10) -> float:
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check_mla.json")
    ap.add_argument("--dry-run", action="store_true")
    args, _ = ap.parse_known_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    c = DRY if dry else FULL
    report: dict = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)",
                    "cases": []}

    def candidate():
        if dry:           # the plumbing only: the decompressed torch path as the candidate
            return MLATorchBackend(num_heads=c["heads"], absorbed=False)
        from radixserve.attention.mla_flashinfer import FlashInferMLABackend
        return FlashInferMLABackend(num_heads=c["heads"], kv_lora_rank=c["r"],
                                    rope_dim=c["rope"], sm_scale=(c["nope"] + c["rope"]) ** -0.5,
                                    dtype=dtype, device=device)

    def save(case: dict) -> None:
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    reference = MLATorchBackend(num_heads=c["heads"])
    for page_size in (1, 16):
        step = make_step(c, MIXED, page_size, dtype, device)
        ref = run_once(reference, make_step(c, MIXED, page_size, torch.float32, device)).float()
        got = run_once(candidate(), step).float()
        err = (got - ref).abs().max().item()
        bound = 1e-4 if dry else 0.02 * max(ref.abs().max().item(), 1.0)
        save({"case": f"mixed step, page_size {page_size}", "max_abs_err": err,
              "bound": bound, "ok": err <= bound})
    for batch in ((4,) if dry else (32, 128)):
        context = 64 if dry else 2048
        step = make_step(c, [(context, 1)] * batch, 16, dtype, device)
        cand = candidate()
        times = {"torch_absorbed_ms": timed_ms(lambda: run_once(reference, step), device),
                 "candidate_ms": timed_ms(lambda: run_once(cand, step), device)}
        save({"case": f"decode batch {batch} x {context} cached", **times})
    return 0 if all(x.get("ok", True) for x in report["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
