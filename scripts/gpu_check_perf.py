"""The `throughput` section's measurements against the device's own limits.

Each figure is a ratio to a floor measured on the same device in the same run:
  - decode at each batch (64 and 256 on a GPU) on the Llama-3-8B-shaped model: ms per step
    vs the HBM floor, (weight bytes + KV bytes read per step) / measured copy bandwidth
    (a device-to-device copy, bytes read + written per second);
  - prefill of one 4k-token chunk: achieved FLOP/s vs a measured bf16 matmul peak
    (8192^3 on a GPU), FLOPs = 2 x linear weights x tokens + causal attention;
  - fp8 KV decode vs bf16 KV decode (ms per step, same batch and context);
  - host-tier load vs recompute, per token: a pinned host -> device copy of a token's KV
    bytes (what the host tier's load moves) vs a 4k prefill's time per token.
"""

from __future__ import annotations

import time
from types import ModuleType


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, repeats: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, repeats=10)


def matmul_peak(device: str, dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` on random data."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / _timed(lambda: a @ b, device, repeats=10)


def host_to_device_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a pinned host -> device copy (the host tier's load)."""
    import torch

    pin = device == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=pin), device, repeats=5)


def linear_weight_bytes(loaded) -> int:
    """Bytes of every weight a decode step reads in full (all but the embedding table,
    whose rows are gathered; a tied LM head reads it in full once)."""
    model = loaded.model
    total = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if "embed_tokens" not in name)
    if loaded.config.tie_word_embeddings:
        w = model.embed_tokens.weight
        total += w.numel() * w.element_size()
    return total


def kv_bytes_per_token(loaded, kv_element_bytes: int) -> int:
    mc = loaded.config
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * kv_element_bytes


def prefill_flops(loaded, tokens: int) -> float:
    """2 x linear weights x tokens, plus causal attention (QK and PV: 2 x 2 x d per
    query-key pair, T^2/2 pairs per head and layer)."""
    mc = loaded.config
    linear_params = linear_weight_bytes(loaded) / loaded.model.embed_tokens.weight.element_size()
    attention = 2 * 2 * mc.head_dim * mc.num_heads * mc.num_layers * tokens * tokens / 2
    return 2 * linear_params * tokens + attention


def prefill_run(runner, tokens: int) -> float:
    """Seconds for one prefill step of ``tokens`` new tokens (one sequence), warm."""
    import numpy as np

    from radixserve.attention.metadata import SeqSpan
    from radixserve.engine.batch import StepBatch
    from radixserve.engine.sampling_params import SamplingParams

    ids = np.random.default_rng(0).integers(200, 48000, size=tokens).tolist()
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def step():
        runner.execute(StepBatch(input_ids=ids, positions=list(range(tokens)),
                                 spans=[SeqSpan(np.arange(tokens, dtype=np.int32), 0, tokens)],
                                 sample_rows=[0], sample_params=[greedy], generators=[None]))

    step()                                # warm-up (and JIT, if any)
    t0 = time.perf_counter()
    step()                                # the sampler's .tolist() syncs
    return time.perf_counter() - t0


def decode_vs_floor(gc: ModuleType, ctx, loaded, kv_cache_dtype: str) -> dict:
    """Decode at each of ctx.sizes.decode_batches, each against its HBM floor."""
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.runner import ModelRunner

    sz = ctx.sizes
    span = sz.decode_context + sz.decode_warmup + sz.decode_steps
    runner = ModelRunner(EngineConfig(attention_backend=ctx.backend_under_test,
                                      kv_cache_dtype=kv_cache_dtype,
                                      kv_cache_tokens=max(sz.decode_batches) * span), loaded)
    bandwidth = copy_bandwidth(ctx.device, sz.bandwidth_probe_bytes)
    weights = linear_weight_bytes(loaded)
    kv_elem = runner.kv_pool.k[0].element_size()
    out = {"attention_backend": runner.backend.name, "kv_cache_dtype": kv_cache_dtype,
           "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "weight_gb": round(weights / 1e9, 2),
           "results": []}
    for batch in sz.decode_batches:
        note = ctx.budget.skip_note(sz.item_min_s)
        if note:
            out["results"].append({"batch": batch, "status": "skipped", "note": note})
            continue
        try:
            r = gc._decode_run(runner, batch, sz, batch)
        except Exception as exc:
            out["results"].append({"batch": batch, **gc._error(exc)})
            continue
        mean_context = sz.decode_context + sz.decode_warmup + sz.decode_steps / 2
        kv = batch * mean_context * kv_bytes_per_token(loaded, kv_elem)
        floor_ms = (weights + kv) / bandwidth * 1e3
        r.update(status="ok", kv_gb_per_step=round(kv / 1e9, 3),
                 hbm_floor_ms=round(floor_ms, 3),
                 floor_over_measured=round(floor_ms / r["ms_per_step"], 3))
        out["results"].append(r)
        gc.flush(ctx.report)
    del runner
    gc._release_memory()
    return out


def prefill_vs_peak(gc: ModuleType, ctx, loaded) -> dict:
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.runner import ModelRunner

    sz = ctx.sizes
    tokens = sz.prefill_tokens
    runner = ModelRunner(EngineConfig(attention_backend=ctx.backend_under_test,
                                      kv_cache_tokens=tokens + 16), loaded)
    seconds = prefill_run(runner, tokens)
    peak = matmul_peak(ctx.device, loaded.dtype, sz.matmul_probe_n)
    flops = prefill_flops(loaded, tokens)
    per_token_kv = kv_bytes_per_token(loaded, runner.kv_pool.k[0].element_size())
    h2d = host_to_device_bandwidth(ctx.device, per_token_kv * tokens)
    del runner
    gc._release_memory()
    load_s = per_token_kv / h2d
    recompute_s = seconds / tokens
    return {"tokens": tokens, "seconds": round(seconds, 4),
            "achieved_tflop_s": round(flops / seconds / 1e12, 4),
            "matmul_peak_tflop_s": round(peak / 1e12, 4),
            "share_of_peak": round(flops / seconds / peak, 3),
            "host_tier": {"kv_bytes_per_token": per_token_kv,
                          "host_to_device_gb_s": round(h2d / 1e9, 2),
                          "load_us_per_token": round(load_s * 1e6, 3),
                          "recompute_us_per_token": round(recompute_s * 1e6, 3),
                          "recompute_over_load": round(recompute_s / load_s, 2)}}


def fp8_vs_bf16(decode_bf16: dict, decode_fp8: dict) -> list[dict]:
    """ms per step of fp8 KV over bf16 KV, batch by batch."""
    rows = []
    for a, b in zip(decode_bf16.get("results", []), decode_fp8.get("results", [])):
        if a.get("status") == b.get("status") == "ok":
            rows.append({"batch": a["batch"], "bf16_ms": a["ms_per_step"],
                         "fp8_ms": b["ms_per_step"],
                         "fp8_over_bf16": round(b["ms_per_step"] / a["ms_per_step"], 3)})
    return rows
