"""The `fp8_kv` section of scripts/gpu_check.py: flashinfer reading an FP8 KV cache.

flashinfer's paged kernels take the KV dtype in ``plan(..., kv_data_type=float8_e4m3fn)`` and
one scalar scale per tensor in ``run(..., k_scale=, v_scale=)``; radixserve stores FP8 K/V
for them with a fixed scale of 1.0 (radixserve.attention.kv_quant). Checked here:
  - kernels: the flashinfer backend over an fp8_e4m3 / fp8_e5m2 pool against the torch
    backend over the same pool (which decodes in its gather) and against fp32 dense
    attention on the decoded K/V; bf16 queries; page sizes 1 and 16; two head shapes;
  - model: greedy replies of the default model with FP8 KV (flashinfer) and with bf16 KV
    (flashinfer), tokens until the first divergence, and the pool sizes.
"""

from __future__ import annotations

import time
from types import ModuleType

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
FP8_HEADS = [(9, 3, 64), (32, 8, 128)]
# |flashinfer - dense on decoded K/V| within gpu_check.attention_error_bound (bf16): the
# kernels see the same codes; what differs is bf16 arithmetic inside them.


def _case(gc: ModuleType, fmt: str, hq: int, hkv: int, d: int, ps: int, lens, seed: int,
          device: str, stand_in: bool) -> dict:
    import torch

    from radixserve.attention.backend import create_backend
    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.metadata import build_metadata
    from radixserve.kv_sizing import KVFormat

    kv = KVFormat(fmt, fmt)
    kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
              device=device)
    fi = create_backend("torch" if stand_in else "flashinfer", **kw, kv_format=kv)
    ref = create_backend("torch", **kw, kv_format=kv)
    num_pages = sum(-(-(c + n) // ps) for c, n in lens) + 8
    outs = []
    for backend in (fi, ref):
        # Both pools use the per-tensor scale flashinfer reads, so they hold the same codes.
        pool = KVPool(1, num_pages, ps, hkv, d, torch.bfloat16, device, kv_format=kv,
                      fixed_scale=1.0)
        spans, fulls, q, k, v = gc._scenario(pool, lens, hq, seed, device)
        meta = build_metadata(spans, ps, device)
        outs.append(backend.forward(backend.prepare(meta), 0, q, k, v, pool).float())
    # Dense attention over exactly what the pages hold, decoded (the reference pool's).
    decoded = []
    for span in spans:
        pos = torch.arange(span.cached_len + span.new_len)
        pages = torch.as_tensor(span.pages, dtype=torch.long)
        slots = (pages[pos // ps] * ps + pos % ps).to(device)
        decoded.append(tuple(
            codec.decode(data[slots], scales[slots], torch.float32)
            for codec, data, scales in (pool.side("k", 0), pool.side("v", 0))))
    dense, bound = gc._dense_reference(spans, decoded, q)
    row = {"kv": fmt, "num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d,
           "page_size": ps, "tokens": meta.num_tokens,
           "max_abs_err_flashinfer_vs_torch": (outs[0] - outs[1]).abs().max().item(),
           "max_abs_err_flashinfer_vs_dense": (outs[0] - dense).abs().max().item(),
           "finite": bool(torch.isfinite(outs[0]).all())}
    row["largest_bound"] = bound.max().item()
    row["ok"] = row["finite"] and bool(((outs[0] - dense).abs() <= bound).all())
    return row


def _greedy(gc: ModuleType, ctx, fmt: str) -> dict:
    loaded = ctx.model()
    prompts = [loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": gc.GREEDY_SYSTEM}, {"role": "user", "content": q}])
        for q in gc.GREEDY_QUESTIONS[:ctx.sizes.greedy_questions]]
    backend = ctx.backend_under_test
    return gc._greedy_run(loaded, prompts, ctx.sizes.greedy_tokens,
                          attention_backend=backend, kv_cache_dtype=fmt,
                          kv_cache_tokens=ctx.sizes.engine_kv_tokens)


def check_fp8_kv(report: dict, gc: ModuleType, ctx, quick: bool = False) -> None:
    stand_in = ctx.dry_run
    lens_cases = {k: v for k, v in gc.KERNEL_CASES.items() if k in ("mixed", "decode")}
    rows: list[dict] = []
    section = report["fp8_kv"] = {
        "status": "running", "stand_in_for_flashinfer": "torch" if stand_in else None,
        "tolerance": "gpu_check.attention_error_bound (bf16)", "num_checks": 0,
        "failed": [], "results": rows}
    for fmt in FP8_FORMATS[:1] if quick else FP8_FORMATS:
        for hq, hkv, d in FP8_HEADS:
            for ps in gc.PAGE_SIZES:
                for case, lens in lens_cases.items():
                    row = {"case": case, "kv": fmt, "page_size": ps}
                    t0 = time.perf_counter()
                    try:
                        row.update(_case(gc, fmt, hq, hkv, d, ps, lens, len(rows), ctx.device,
                                         stand_in))
                    except Exception as exc:      # recorded; the next case still runs
                        row.update(gc._error(exc), ok=False)
                    row["seconds"] = round(time.perf_counter() - t0, 2)   # JIT included
                    rows.append(row)
                    section["num_checks"] = len(rows)
                    section["failed"] = [r for r in rows if not r["ok"]]
                    gc.flush(report)
    section["status"] = "ok" if all(r["ok"] for r in rows) else "FAILED"
    bf16 = _greedy(gc, ctx, "auto")
    fp8 = _greedy(gc, ctx, "fp8_e4m3")
    section["greedy"] = {
        "tokens_until_divergence_fp8_vs_bf16_kv": [
            gc.first_divergence(a, b) for a, b in zip(fp8["token_ids"], bf16["token_ids"])],
        "attention_backend": fp8["attention_backend"],
        "kv_pool_gib": {"auto": bf16["kv_pool_gib"], "fp8_e4m3": fp8["kv_pool_gib"]}}
