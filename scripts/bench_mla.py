"""MLA's payoff on a DeepSeek-V2-Lite-shaped config (random weights): bytes per cached
token against the same model with full multi-head KV, distinct 4k-token system prompts a
4 GiB pool holds either way (from the pools' own sizing), and one decode step's attention
at batch 32 with 2k cached tokens each, absorbed vs decompressed, measured side by side.

The config is DeepSeek-V2-Lite's attention (27 layers, 16 heads, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128). Sizes use all 27 layers; the
timing runs ONE layer's latent attention (kv_b_proj random, pool filled with random
latents; the MoE and projections are the same in both paths and left out), so a whole
decode step's attention is about 27x the per-layer figure.

    PYTHONPATH=. python scripts/bench_mla.py [--batch 32] [--context 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.attention.mla_torch import MLATorchBackend
from radixserve.attention.mla_weights import LatentProjections
from radixserve.kv_sizing import CPU_KV_BUDGET_BYTES, pool_pages

V2_LITE = dict(layers=27, heads=16, kv_lora_rank=512, rope=64, nope=128, v=128)
PROMPT_TOKENS = 4096


def sizes(dtype: torch.dtype, page_size: int, element: str | None = None) -> None:
    c = V2_LITE
    itemsize = torch.empty((), dtype=dtype).element_size()
    element = element or str(dtype).removeprefix("torch.")
    latent = LatentKVPool.token_bytes(c["layers"], c["kv_lora_rank"], c["rope"], element)
    # full MHA KV: every head's key (nope + rope) and value, every layer
    mha = c["layers"] * c["heads"] * (c["nope"] + c["rope"] + c["v"]) * itemsize
    print(f"DeepSeek-V2-Lite shape, {element} latents vs {str(dtype).removeprefix('torch.')} "
          f"full MHA KV, page_size {page_size}")
    print(f"  bytes per cached token: latent {latent:,} B, full MHA {mha:,} B "
          f"({mha / latent:.2f}x smaller with MLA)")
    fits = {}
    for name, token_bytes in (("latent", latent), ("full MHA", mha)):
        pages = pool_pages(token_bytes=token_bytes, page_size=page_size, kv_cache_tokens=None,
                           budget=CPU_KV_BUDGET_BYTES)
        fits[name] = pages // -(-PROMPT_TOKENS // page_size)
        print(f"  4 GiB pool, {name}: {pages * page_size:,} tokens = {fits[name]} distinct "
              f"{PROMPT_TOKENS}-token system prompts")
    print(f"  -> {fits['latent'] - fits['full MHA']} more prompts "
          f"({fits['latent'] / max(fits['full MHA'], 1):.2f}x)")


def decode_step(batch: int, context: int, dtype: torch.dtype, page_size: int,
                element: str | None = None):
    """(proj, pool, meta, inputs): one decode step over random latents (seeded: every
    element format gets the same values before storing)."""
    c = V2_LITE
    g = torch.Generator().manual_seed(0)
    proj = LatentProjections(c["heads"], c["nope"], c["v"], c["kv_lora_rank"],
                             (c["nope"] + c["rope"]) ** -0.5)
    proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * 0.05)
    proj.to(dtype)
    per_seq = -(-(context + 1) // page_size)
    pool = LatentKVPool(1, batch * per_seq, page_size, c["kv_lora_rank"], c["rope"], dtype,
                        "cpu", element=element)
    slots = torch.arange(pool.num_slots)
    pool.write(0, slots, torch.randn(len(slots), c["kv_lora_rank"], generator=g).to(dtype),
               torch.randn(len(slots), c["rope"], generator=g).to(dtype))
    pages = np.random.default_rng(0).permutation(batch * per_seq).astype(np.int32)
    spans = [SeqSpan(pages[i * per_seq:(i + 1) * per_seq], context, 1) for i in range(batch)]
    meta = build_metadata(spans, page_size, "cpu")
    inputs = (torch.randn(batch, c["heads"], c["nope"], generator=g).to(dtype),
              torch.randn(batch, c["heads"], c["rope"], generator=g).to(dtype),
              torch.randn(batch, c["kv_lora_rank"], generator=g).to(dtype),
              torch.randn(batch, c["rope"], generator=g).to(dtype))
    return proj, pool, meta, inputs


def latent_format_errors(batch: int, context: int, page_size: int) -> None:
    """8-bit latents (one scale per token and layer) against fp32 latents: the absorbed
    decode output's error, relative to the output's largest magnitude."""
    backend = MLATorchBackend(num_heads=V2_LITE["heads"])

    def out(element):
        proj, pool, meta, inputs = decode_step(batch, context, torch.float32, page_size,
                                               element)
        with torch.inference_mode():
            return backend.forward_latent(backend.prepare(meta), 0, *inputs, proj, pool)
    ref = out(None)
    print(f"8-bit latents, absorbed decode output vs fp32 latents (batch {batch} x "
          f"{context} cached, random latents):")
    for element in ("int8", "fp8_e4m3"):
        err = (out(element) - ref).abs()
        print(f"  {element:9s} max |err| / max |out| {err.max() / ref.abs().max():.2e}, "
              f"mean |err| / mean |out| {err.mean() / ref.abs().mean():.2e}")


def decode_times(batch: int, context: int, repeats: int, dtype: torch.dtype,
                 page_size: int) -> None:
    c = V2_LITE
    proj, pool, meta, (q_nope, q_pe, ckv, kpe) = decode_step(batch, context, dtype, page_size)
    backends = {"absorbed": MLATorchBackend(num_heads=c["heads"], absorbed=True),
                "decompressed": MLATorchBackend(num_heads=c["heads"], absorbed=False)}
    times: dict[str, list[float]] = {k: [] for k in backends}
    outs = {}
    with torch.inference_mode():
        for _ in range(repeats + 1):              # first round: warm-up, not counted
            for name, backend in backends.items():   # alternated, side by side
                plan = backend.prepare(meta)
                start = time.perf_counter()
                outs[name] = backend.forward_latent(plan, 0, q_nope, q_pe, ckv, kpe, proj, pool)
                times[name].append(time.perf_counter() - start)
    err = (outs["absorbed"].float() - outs["decompressed"].float()).abs().max().item()
    print(f"decode attention, one layer, batch {batch} x {context} cached tokens, "
          f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"median of {repeats}:")
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    for name, t in med.items():
        print(f"  {name:12s} {t * 1e3:9.1f} ms   (x27 layers: {27 * t * 1e3:,.0f} ms)")
    print(f"  absorbed is {med['decompressed'] / med['absorbed']:.2f}x faster; "
          f"max |out diff| {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    sizes(torch.bfloat16, args.page_size)
    sizes(torch.bfloat16, args.page_size, element="fp8_e4m3")
    latent_format_errors(4, 512, args.page_size)
    decode_times(args.batch, args.context, args.repeats, dtype, args.page_size)


if __name__ == "__main__":
    main()
