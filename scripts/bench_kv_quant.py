#!/usr/bin/env python
"""Quality and cost of each KV cache dtype, measured on a real model and a shipped text.

For every KV format (fp32, bf16, fp8_e4m3, fp8_e5m2, int8, K bf16 / V fp8_e4m3):
- teacher-forced logits over scripts/data/kv_quant_text.md (the project's own docs, >= 4,000
  tokens), prefilled in chunks so later chunks read earlier ones from quantized pages: max
  and mean |logit - logit with bf16 KV| and mean KL(bf16 KV || this KV) per token;
- greedy agreement: 32 prompts (slices of the text) x 64 greedy tokens, decoded together,
  tokens until the first divergence from bf16 KV (and, for bf16 KV, from fp32 KV);
- tokens per GiB of KV (scales included), and the speed of a --speed-batch decode step
  and of a prefill with the model in --speed-dtype (auto: as the server), formats interleaved round-robin so load
  from elsewhere hits them alike.
Quality runs the model in fp32 (so fp32 KV is exact and bf16 KV a real reference).

    python scripts/bench_kv_quant.py                  # the figures for docs/benchmarks.md
    python scripts/bench_kv_quant.py --quick          # a smoke run (tiny sizes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from radixserve.attention import SeqSpan, build_metadata, create_backend
from radixserve.attention.context import ForwardContext
from radixserve.attention.kv_pool import KVPool
from radixserve.kv_sizing import KVFormat
from radixserve.model import load_model

TEXT = Path(__file__).resolve().parent / "data" / "kv_quant_text.md"
FORMATS = {"float32": ("float32", "float32"), "bfloat16": ("bfloat16", "bfloat16"),
           "fp8_e4m3": ("fp8_e4m3", "fp8_e4m3"), "fp8_e5m2": ("fp8_e5m2", "fp8_e5m2"),
           "int8": ("int8", "int8"), "k_bf16_v_fp8_e4m3": ("bfloat16", "fp8_e4m3")}
REFERENCE = "bfloat16"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text-tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (teacher forcing)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--speed-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="model dtype of the speed runs (auto: what the server picks here)")
    p.add_argument("--speed-batch", type=int, default=32)
    p.add_argument("--speed-context", type=int, default=512)
    p.add_argument("--speed-steps", type=int, default=8)
    p.add_argument("--speed-rounds", type=int, default=3)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.text_tokens, args.chunk, args.prompts, args.greedy_tokens = 256, 128, 4, 8
        args.speed_batch, args.speed_context, args.speed_steps, args.speed_rounds = 4, 64, 2, 1
    return args


class Runner:
    """The model over one KVPool in a given KV format; each sequence owns whole pages."""

    def __init__(self, loaded, fmt: tuple[str, str], batch: int, max_len: int):
        cfg = loaded.config
        self.model, self.max_len = loaded.model, max_len
        self.pool = KVPool(cfg.num_layers, batch * max_len, 1, cfg.num_kv_heads, cfg.head_dim,
                           loaded.dtype, loaded.device, kv_format=KVFormat(*fmt))
        self.backend = create_backend("torch", num_qo_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      dtype=loaded.dtype, device=loaded.device,
                                      kv_format=self.pool.kv_format)
        self.pages = [np.arange(b * max_len, (b + 1) * max_len, dtype=np.int32)
                      for b in range(batch)]

    @torch.inference_mode()
    def step(self, tokens: list[list[int]], cached: list[int], all_logits: bool = False):
        spans = [SeqSpan(self.pages[b], cached[b], len(t)) for b, t in enumerate(tokens)]
        meta = build_metadata(spans, 1, "cpu")
        ids = torch.tensor([x for t in tokens for x in t])
        pos = torch.cat([torch.arange(c, c + len(t)) for c, t in zip(cached, tokens)])
        rows = (torch.arange(len(ids)) if all_logits
                else torch.tensor(np.cumsum([len(t) for t in tokens]) - 1))
        return self.model(ids, pos, ForwardContext.prepare(self.backend, meta, self.pool), rows)


def teacher_forced(loaded, text_ids: list[int], chunk: int, names: list[str]) -> dict:
    runners = {n: Runner(loaded, FORMATS[n], 1, len(text_ids)) for n in names}
    stats = {n: {"max_abs": 0.0, "sum_abs": 0.0, "sum_kl": 0.0} for n in names}
    count = 0
    for start in range(0, len(text_ids), chunk):
        piece = text_ids[start:start + chunk]
        logits = {n: r.step([piece], [start], all_logits=True).float()
                  for n, r in runners.items()}
        ref = logits[REFERENCE]
        ref_logp = ref.log_softmax(-1)
        for n in names:
            diff = (logits[n] - ref).abs()
            s = stats[n]
            s["max_abs"] = max(s["max_abs"], diff.max().item())
            s["sum_abs"] += diff.mean(-1).sum().item()
            logp = logits[n].log_softmax(-1)
            s["sum_kl"] += (ref_logp.exp() * (ref_logp - logp)).sum(-1).sum().item()
        count += len(piece)
    return {n: {"max_abs_logit_err": s["max_abs"], "mean_abs_logit_err": s["sum_abs"] / count,
                "mean_kl": s["sum_kl"] / count} for n, s in stats.items()}


def greedy(loaded, prompts: list[list[int]], new_tokens: int, fmt: tuple[str, str]) -> list:
    r = Runner(loaded, fmt, len(prompts), max(map(len, prompts)) + new_tokens)
    cached = [0] * len(prompts)
    logits = r.step(prompts, cached)
    cached = [len(p) for p in prompts]
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(new_tokens - 1):
        logits = r.step([[o[-1]] for o in out], cached)
        cached = [c + 1 for c in cached]
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
            for s, t in zip(a, b)]


def speed(loaded, names: list[str], args) -> dict:
    """Decode step at --speed-batch and a prefill of --speed-context x 4 tokens, ms, interleaved."""
    b, ctx = args.speed_batch, args.speed_context
    rng = np.random.default_rng(0)
    vocab = loaded.config.vocab_size
    prompts = [rng.integers(0, vocab, ctx).tolist() for _ in range(b)]
    runners = {}
    for n in names:
        r = Runner(loaded, FORMATS[n], b, ctx + args.speed_steps * args.speed_rounds + 8)
        r.step(prompts, [0] * b)
        runners[n] = r
    decode = {n: [] for n in names}
    prefill = {n: [] for n in names}
    long_prompt = rng.integers(0, vocab, 4 * ctx).tolist()
    pre = {n: Runner(loaded, FORMATS[n], 1, 4 * ctx) for n in names}
    cached = ctx
    for _ in range(args.speed_rounds):
        for n in names:
            t0 = time.perf_counter()
            for i in range(args.speed_steps):
                runners[n].step([[1]] * b, [cached + i] * b)
            decode[n].append((time.perf_counter() - t0) / args.speed_steps * 1e3)
            t0 = time.perf_counter()
            pre[n].step([long_prompt], [0])
            prefill[n].append((time.perf_counter() - t0) * 1e3)
        cached += args.speed_steps
    return {n: {"decode_step_ms": statistics.median(decode[n]),
                "prefill_ms": statistics.median(prefill[n]),
                "prefill_tokens": 4 * ctx} for n in names}


def main() -> None:
    args = parse_args()
    names = [n.strip() for n in args.formats.split(",")]
    for n in (REFERENCE, "float32"):
        if n not in names:
            names.insert(0, n)
    loaded = load_model(args.model, dtype="float32")
    cfg = loaded.config
    text_ids = loaded.tokenizer.encode(TEXT.read_text())
    if len(text_ids) < args.text_tokens:
        raise SystemExit(f"{TEXT} has {len(text_ids)} tokens, fewer than {args.text_tokens}")
    text_ids = text_ids[:args.text_tokens]
    results: dict = {"model": args.model, "text_tokens": len(text_ids), "formats": {}}
    t0 = time.perf_counter()
    for n in names:
        fmt = KVFormat(*FORMATS[n])
        size = fmt.token_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        results["formats"][n] = {"bytes_per_token": size, "tokens_per_gib": 2**30 // size}
    if not args.skip_quality:
        quality = teacher_forced(loaded, text_ids, args.chunk, names)
        step = (len(text_ids) - args.prompt_len) // max(1, args.prompts)
        prompts = [text_ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
        outs = {n: greedy(loaded, prompts, args.greedy_tokens, FORMATS[n]) for n in names}
        for n in names:
            agree = agreement(outs[n], outs["float32" if n == REFERENCE else REFERENCE])
            results["formats"][n].update({
                **quality[n],
                "greedy_vs": "float32" if n == REFERENCE else REFERENCE,
                "greedy_tokens_until_divergence_mean": statistics.mean(agree),
                "greedy_tokens_until_divergence_min": min(agree),
                "greedy_identical": sum(a == args.greedy_tokens for a in agree)})
    results["quality_s"] = round(time.perf_counter() - t0, 1)
    if not args.skip_speed:
        fast = load_model(args.model, dtype=args.speed_dtype)
        for n, s in speed(fast, names, args).items():
            results["formats"][n].update(s)
        results["speed"] = {"dtype": args.speed_dtype, "batch": args.speed_batch,
                            "context": args.speed_context}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


def print_table(results: dict) -> None:
    base = results["formats"][REFERENCE]
    print(f"\n| KV | bytes/token | tokens/GiB | max abs logit err | mean abs | mean KL | "
          f"greedy agree (mean / min / identical) | decode ms (vs bf16) | prefill ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, r in results["formats"].items():
        d = r.get("decode_step_ms")
        dec = f"{d:.1f} ({d / base['decode_step_ms']:.2f}x)" if d else "-"
        pre = f"{r['prefill_ms']:.0f}" if "prefill_ms" in r else "-"
        quality = (f"{r['max_abs_logit_err']:.4f} | {r['mean_abs_logit_err']:.5f} | "
                   f"{r['mean_kl']:.2e} | {r['greedy_tokens_until_divergence_mean']:.1f} / "
                   f"{r['greedy_tokens_until_divergence_min']} / {r['greedy_identical']} "
                   f"(vs {r['greedy_vs']})") if "mean_kl" in r else "- | - | - | -"
        print(f"| {n} | {r['bytes_per_token']:,} | {r['tokens_per_gib']:,} | {quality} | "
              f"{dec} | {pre} |")


if __name__ == "__main__":
    main()
