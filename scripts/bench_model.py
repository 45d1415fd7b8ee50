#!/usr/bin/env python
"""Model forward throughput: ours (paged KV, torch attention backend) vs transformers.

For each batch size B (1, 8, 32): B random prompts of --prompt-len tokens,
- prefill tokens/s: ours computes all B prompts in one forward step over a KVPool;
  transformers runs one batched forward (use_cache=True) of the same [B, L] ids;
- decode tokens/s: ours runs --decode-steps steps of B single-token decodes (greedy);
  transformers' time is generate(max_new_tokens=1 + N) minus generate(max_new_tokens=1),
  i.e. the N decode steps of `generate` (do_sample=False) with its prefill removed.
Both use the same weights (transformers gets our dequantized HF-named tensors) and dtype,
measured in one run; ratios > 1 mean we are faster.

    python scripts/bench_model.py --quick              # seconds-long smoke run
    python scripts/bench_model.py --dtype bfloat16     # the figures for docs/benchmarks.md
    python scripts/bench_model.py --dtype bfloat16 --weights-dtype int4   # vs our bf16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from radixserve.attention import SeqSpan, build_metadata, create_backend
from radixserve.attention.context import ForwardContext
from radixserve.attention.kv_pool import KVPool
from radixserve.model import load_model
from radixserve.model.hf_reference import hf_model_for


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--weights-dtype", default="bf16", choices=["bf16", "int8", "int4"],
                   help="int8/int4: the comparison column is our own bf16 model, not "
                        "transformers (same prompts, same run)")
    args = p.parse_args()
    if args.quick:
        args.batch_sizes, args.prompt_len, args.decode_steps, args.repeats = "1,2", 8, 3, 1
    return args


class Ours:
    def __init__(self, loaded, batch: int, total_len: int):
        cfg = loaded.config
        self.model, self.batch, self.device = loaded.model, batch, loaded.device
        self.pool = KVPool(cfg.num_layers, batch * total_len, 1, cfg.num_kv_heads, cfg.head_dim,
                           loaded.dtype, loaded.device)
        self.backend = create_backend("torch", num_qo_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      dtype=loaded.dtype, device=loaded.device)
        self.pages = [np.arange(b * total_len, (b + 1) * total_len, dtype=np.int32)
                      for b in range(batch)]

    def step(self, ids: torch.Tensor, cached: int) -> torch.Tensor:
        """ids [B, n]: each sequence's next n tokens after `cached` cached ones."""
        n = ids.shape[1]
        spans = [SeqSpan(p, cached, n) for p in self.pages]
        meta = build_metadata(spans, 1, self.device)
        pos = torch.arange(cached, cached + n).repeat(self.batch)
        ctx = ForwardContext.prepare(self.backend, meta, self.pool)
        return self.model(ids.reshape(-1), pos, ctx, meta.last_token_rows())

    def run(self, prompts: torch.Tensor, steps: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        nxt = self.step(prompts, 0).argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for i in range(steps):
            nxt = self.step(nxt, prompts.shape[1] + i).argmax(-1, keepdim=True)
        return t1 - t0, time.perf_counter() - t1


def hf_run(model, prompts: torch.Tensor, steps: int) -> tuple[float, float]:
    from transformers import GenerationConfig
    mask = torch.ones_like(prompts)

    def generate(n: int) -> float:
        gen = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate(prompts, attention_mask=mask, generation_config=gen)
        assert out.shape[1] == prompts.shape[1] + n
        return time.perf_counter() - t0

    with torch.inference_mode():
        t0 = time.perf_counter()
        model(prompts, attention_mask=mask, use_cache=True)
        prefill = time.perf_counter() - t0
        decode = generate(1 + steps) - generate(1)
    return prefill, max(decode, 1e-9)


def best(fn, repeats: int) -> tuple[float, float]:
    runs = [fn() for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, weights_dtype=args.weights_dtype)
    print(f"model {loaded.name}  dtype {loaded.dtype}  weights {args.weights_dtype}  threads "
          f"{torch.get_num_threads()}  prompt {args.prompt_len}  decode steps "
          f"{args.decode_steps}  best of {args.repeats}")
    if args.weights_dtype != "bf16":      # "hf" columns: our bf16 weights instead
        bf16 = load_model(args.model, dtype=args.dtype)
        hf = None if args.skip_transformers else bf16
        print("comparison columns ('hf'): this checkout with --weights-dtype bf16")
    else:
        hf = None if args.skip_transformers else hf_model_for(args.model, loaded)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    header = (f"{'batch':>5} | {'prefill tok/s':>13} {'hf':>9} {'ratio':>6} | "
              f"{'decode tok/s':>12} {'hf':>9} {'ratio':>6}")
    print(header + "\n" + "-" * len(header))
    # Warm-up (oneDNN primitive creation, allocator) outside the timed runs.
    warm = torch.randint(0, vocab, (1, 8), generator=gen)
    Ours(loaded, 1, 16).run(warm, 2)

    def reference(prompts, steps, total):
        if args.weights_dtype != "bf16":
            return Ours(hf, prompts.shape[0], total).run(prompts, steps)
        return hf_run(hf, prompts, steps)
    if hf is not None:
        reference(warm, 2, 16)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=gen)
        total = args.prompt_len + args.decode_steps + 1
        p, d = best(lambda: Ours(loaded, b, total).run(prompts, args.decode_steps), args.repeats)
        ours_p, ours_d = b * args.prompt_len / p, b * args.decode_steps / d
        if hf is None:
            print(f"{b:>5} | {ours_p:>13.0f} {'-':>9} {'-':>6} | {ours_d:>12.1f} {'-':>9} {'-':>6}")
            continue
        hp, hd = best(lambda: reference(prompts, args.decode_steps, total), args.repeats)
        hf_p, hf_d = b * args.prompt_len / hp, b * args.decode_steps / hd
        print(f"{b:>5} | {ours_p:>13.0f} {hf_p:>9.0f} {ours_p / hf_p:>6.2f} | "
              f"{ours_d:>12.1f} {hf_d:>9.1f} {ours_d / hf_d:>6.2f}")


if __name__ == "__main__":
    main()
