#!/usr/bin/env python
"""Quality of --weights-dtype bf16 / int8 / int4 against the fp32 dequantized reference.

The reference is the GGUF dequantized to float32 and run in float32 (what transformers'
own GGUF reader gives; tests/model/test_model_vs_transformers.py). For each weights dtype
and each activations dtype of --activations (bf16 as served on CPUs with native bf16,
float32 as ``--dtype auto`` serves elsewhere; quantized kernels then compute in bf16):
- greedy agreement: over --prompts chat prompts, the mean number of leading generated
  tokens (of --new-tokens) equal to the reference's;
- KL(reference || candidate) of next-token distributions, mean over every position of a
  held-out text (teacher-forced), and the candidate's perplexity on that text.

    python scripts/bench_weights.py                 # the table in docs/benchmarks.md
    python scripts/bench_weights.py --quick         # smoke run (a few prompts)
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from radixserve.attention import SeqSpan, build_metadata, create_backend
from radixserve.attention.context import ForwardContext
from radixserve.attention.kv_pool import KVPool
from radixserve.model import load_model

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "def fibonacci(n):", "Explain photosynthesis in one sentence.",
             "List three prime numbers.", "Who wrote Hamlet?",
             "Translate 'good morning' into Spanish.", "What is 17 times 3?"]
TOPICS = ["", " Answer briefly.", " Be detailed.", " Use simple words."]
HELD_OUT = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights-dtypes", default="bf16,int8,int4")
    p.add_argument("--activations", default="bfloat16,float32",
                   help="the candidates' model dtypes (bf16 weights in float32 = the reference)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--text-tokens", type=int, default=512, help="held-out text length")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--text", type=Path, default=HELD_OUT,
                   help="the held-out text (e.g. ../shared/seeds/003_63bccb1d10f28eb2.txt)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.text_tokens = 3, 8, 64
    return args


class Sequence:
    """One sequence's forward passes over its own KV pool (page size 1)."""

    def __init__(self, loaded, max_tokens: int):
        cfg = loaded.config
        self.model, self.pos = loaded.model, 0
        self.pool = KVPool(cfg.num_layers, max_tokens, 1, cfg.num_kv_heads, cfg.head_dim,
                           loaded.dtype, loaded.device)
        self.backend = create_backend("torch", num_qo_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                      dtype=loaded.dtype, device=loaded.device)
        self.pages = np.arange(max_tokens, dtype=np.int32)

    def forward(self, ids: list[int], all_rows: bool = False) -> torch.Tensor:
        """float32 logits of the last token ([1, V]) or of every token ([len(ids), V])."""
        meta = build_metadata([SeqSpan(self.pages, self.pos, len(ids))], 1, self.model.device)
        ctx = ForwardContext.prepare(self.backend, meta, self.pool)
        rows = torch.arange(len(ids)) if all_rows else meta.last_token_rows()
        logits = self.model(torch.tensor(ids), torch.arange(self.pos, self.pos + len(ids)),
                            ctx, rows)
        self.pos += len(ids)
        return logits


def greedy(loaded, prompt: list[int], n: int) -> list[int]:
    seq = Sequence(loaded, len(prompt) + n)
    out = [int(seq.forward(prompt).argmax())]
    while len(out) < n:
        out.append(int(seq.forward([out[-1]]).argmax()))
    return out


def text_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """log-softmax of next-token logits at every position but the last ([T-1, V])."""
    return torch.log_softmax(Sequence(loaded, len(ids)).forward(ids, all_rows=True)[:-1], -1)


def leading_matches(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = load_model(args.model, dtype="float32", weights_dtype="bf16")
    tok = ref.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q + t}])
               for t in TOPICS for q in QUESTIONS][:args.prompts]
    text = tok.encode(args.text.read_text())[:args.text_tokens]
    ref_tokens = [greedy(ref, p, args.new_tokens) for p in prompts]
    ref_lp = text_logprobs(ref, text)
    targets = torch.tensor(text[1:])

    def perplexity(lp: torch.Tensor) -> float:
        return math.exp(-lp.gather(1, targets[:, None]).mean().item())

    print(f"model {args.model}; {len(prompts)} prompts x {args.new_tokens} greedy tokens; "
          f"held-out text {len(text)} tokens ({args.text.name}); threads "
          f"{torch.get_num_threads()}")
    print("| weights | activations | greedy tokens matching fp32 ref (mean of "
          f"{args.new_tokens}) | prompts fully equal | KL(ref‖w) mean | perplexity |")
    print("|---|---|---|---|---|---|")
    print(f"| fp32 reference | float32 | {args.new_tokens} | {len(prompts)} | 0 | "
          f"{perplexity(ref_lp):.3f} |")
    for wd, act in ((w, a) for a in args.activations.split(",")
                    for w in args.weights_dtypes.split(",")):
        if (wd, act) == ("bf16", "float32"):
            continue                              # the reference itself
        t0 = time.perf_counter()
        cand = load_model(args.model, dtype=act, weights_dtype=wd)
        toks = [greedy(cand, p, args.new_tokens) for p in prompts]
        matches = [leading_matches(a, b) for a, b in zip(ref_tokens, toks)]
        lp = text_logprobs(cand, text)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        print(f"| {wd} | {act} | {np.mean(matches):.2f} | "
              f"{sum(m == args.new_tokens for m in matches)} | {kl:.5f} | "
              f"{perplexity(lp):.3f} |  ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
