#!/usr/bin/env python
"""One engine step, this checkout against a baseline commit, interleaved in one process.

The issue-18 workload's decode step: 64 sequences in 8 groups, each group sharing a
1,024-token system prompt (the same pages, as the radix cache hands them out) followed by
~64-95 private tokens, one new token each (contexts ~1,090-1,120). Optionally a prefill
step of ``--prefill-tokens`` (8 prompts of 64 tokens behind a cached system prompt, or one
fresh prompt) is timed the same way.

Both implementations run ``ModelRunner.execute`` (page table, plan, forward, greedy sample)
on the same weights and the same K/V contents. The baseline is the ``radixserve`` package of
a git commit, extracted with ``git archive`` and renamed to ``radixserve_base`` so both
import side by side. Rounds alternate which one goes first; the ratio of medians per round
cancels the load other processes put on the machine.

    python scripts/bench_decode_step.py --baseline e33df27 --rounds 6 --steps 5 --threads 2
    python scripts/bench_decode_step.py --baseline e33df27 --threads 1 --clock cpu   # shared
    python scripts/bench_decode_step.py --profile            # top operators, this checkout
    python scripts/bench_decode_step.py --batch 1 --groups 1 --dtype float32 \
        --weights-dtypes bf16,int8,int4 --threads 1 --clock cpu    # weights forms side by side
    python scripts/bench_decode_step.py --batch 32 --groups 1 --dtype float32 \
        --weights-dtypes bf16,int4,int4+float --threads 1 --clock cpu  # int4 by rows
    python scripts/bench_decode_step.py --batch 1 --groups 1 --system 32 --dtype float32 \
        --weights-dtypes int4 --compile --threads 1 --clock cpu   # torch.compile'd layers
    python scripts/bench_decode_step.py --baseline c27fc98 --batch 1 --groups 1 \
        --system 512 --page-order reversed --attention-only --threads 1 --clock cpu
        # a lone decode's attention per step, pages as the allocator hands them out
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def import_baseline(commit: str, workdir: Path):
    """The ``radixserve`` package of ``commit`` as a top-level package ``radixserve_base``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "radixserve"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
    src = workdir / "radixserve"
    dst = workdir / "radixserve_base"
    src.rename(dst)
    pattern = re.compile(r"\bradixserve(?=[. ])")
    for path in dst.rglob("*.py"):
        text = path.read_text()
        path.write_text(pattern.sub("radixserve_base", text))
    sys.path.insert(0, str(workdir))
    return "radixserve_base"


class Impl:
    """A runner of one implementation (package ``pkg``) with the workload's steps."""

    def __init__(self, pkg: str, args, fill_seed: int = 0, weights_dtype: str | None = None):
        self.name = pkg if weights_dtype is None else f"{pkg}[{weights_dtype}]"
        mod = lambda m: importlib.import_module(f"{pkg}.{m}")   # noqa: E731
        config = mod("engine.config").EngineConfig(
            model=args.model, dtype=args.dtype, kv_cache_tokens=args.kv_tokens)
        loaded = (mod("model").load_model(args.model, dtype=args.dtype) if weights_dtype is None
                  else mod("model").load_model(args.model, dtype=args.dtype,
                                               weights_dtype=weights_dtype))
        self.runner = mod("engine.runner").ModelRunner(config, loaded)
        self.StepBatch = mod("engine.batch").StepBatch
        self.SeqSpan = mod("attention.spans").SeqSpan
        self.Params = mod("engine.sampling_params").SamplingParams
        self.build_metadata = mod("attention.metadata").build_metadata
        self.ForwardContext = mod("attention.context").ForwardContext
        pool = self.runner.kv_pool
        gen = torch.Generator().manual_seed(fill_seed)
        used = args.kv_tokens
        for side in (pool.k_flat, pool.v_flat):
            for layer in side:
                layer[:used].copy_(torch.randn(layer[:used].shape, generator=gen) * 0.5)

    def decode_batch(self, args):
        spans, ids, pos = [], [], []
        shared = args.system
        private_base = args.groups * shared
        private = args.question + 32
        for i in range(args.batch):
            g = i % args.groups
            own = args.question + (i * 7) % 32          # 64..95 private tokens
            pages = np.concatenate([
                np.arange(g * shared, (g + 1) * shared),
                private_base + i * private + np.arange(own + 1)]).astype(np.int32)
            spans.append(self.SeqSpan(order_pages(pages, args.page_order, i), shared + own, 1))
            ids.append(1000 + i)
            pos.append(shared + own)
        return self._batch(spans, ids, pos)

    def prefill_batch(self, args):
        """8 questions of 64 tokens behind one cached system prompt each (cache on)."""
        spans, ids, pos = [], [], []
        shared = args.system
        private_base = args.groups * shared
        private = args.question + 32
        n = args.prefill_tokens // args.question
        for i in range(n):
            g = i % args.groups
            pages = np.concatenate([np.arange(g * shared, (g + 1) * shared),
                                    private_base + i * private + np.arange(args.question)])
            spans.append(self.SeqSpan(pages.astype(np.int32), shared, args.question))
            ids += [2000 + i + j for j in range(args.question)]
            pos += list(range(shared, shared + args.question))
        return self._batch(spans, ids, pos)

    def _batch(self, spans, ids, pos):
        n = len(spans)
        return self.StepBatch(input_ids=ids, positions=pos, spans=spans,
                              sample_rows=list(range(n)),
                              sample_params=[self.Params(max_tokens=1, temperature=0.0)] * n,
                              generators=[None] * n)

    @torch.inference_mode()
    def attention_step(self, batch) -> None:
        """A decode step's attention alone: the page table, the plan and every layer's
        forward (K/V write and attention), on fixed random q/k/v of the step's shapes."""
        r = self.runner
        meta = self.build_metadata(batch.spans, r.page_size, r.device)
        ctx = self.ForwardContext.prepare(r.backend, meta, r.kv_pool)
        q, k, v = self._qkv(meta.num_tokens)
        for layer in range(len(r.model.layers)):
            ctx.attention(layer, q, k, v)

    def _qkv(self, tokens: int):
        cfg = self.runner.model.config
        gen = torch.Generator().manual_seed(tokens)
        dt = self.runner.model.dtype
        return tuple(torch.randn(tokens, heads, cfg.head_dim, generator=gen).to(dt)
                     for heads in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))

    def time_steps(self, batch, steps: int, clock, attention_only: bool = False) -> float:
        """Median seconds of ``steps`` executions of ``batch`` (or of its attention)."""
        run = self.attention_step if attention_only else self.runner.execute
        times = []
        for _ in range(steps):
            t0 = clock()
            run(batch)
            times.append(clock() - t0)
        return statistics.median(times)


def order_pages(pages: np.ndarray, order: str, seed: int) -> np.ndarray:
    """A sequence's page ids in the order a test of the attention path wants: as built
    (ascending), each part reversed as the page allocator hands out a fresh prompt
    (``reversed``: its stack pops the lowest id first), or shuffled (no runs at all)."""
    if order == "reversed":
        return pages[::-1].copy()
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(pages)
    return pages


def compile_layers(impl: Impl) -> None:
    """torch.compile (inductor) each decoder layer of ``impl`` around its attention call:
    the norm, q/k/v projection and RoPE before it, o_proj, residuals and the MLP after it,
    one graph each, shared by all layers (their weights are graph inputs). The attention
    reads pages through the step's context, so it stays eager between the two graphs.
    Llama-family layers (no q/k norm) only: an experiment, not a serving path."""
    rope = importlib.import_module(f"{type(impl.runner.model).__module__.rsplit('.', 1)[0]}"
                                   ".rope")

    def before(layer, h, cos, sin):
        t, hq, d = h.shape[0], layer.num_heads, layer.head_dim
        qkv = layer.qkv_proj(layer.input_layernorm(h))
        qk = qkv[:, :layer.split[0] + layer.split[1]].view(t, hq + layer.num_kv_heads, d)
        qk = rope.apply_rotary(qk, cos, sin)
        v = qkv[:, layer.split[0] + layer.split[1]:].view(t, layer.num_kv_heads, d)
        return qk[:, :hq], qk[:, hq:], v

    def after(layer, h, o):
        h = h + layer.o_proj(o.reshape(o.shape[0], -1))
        return h + layer.mlp_block(layer.post_attention_layernorm(h))

    c_before = torch.compile(before, dynamic=False)
    c_after = torch.compile(after, dynamic=False)

    def forward(layer, h, cos, sin, ctx):
        q, k, v = c_before(layer, h, cos, sin)
        return c_after(layer, h, ctx.attention(layer.index, q, k, v))

    for layer in impl.runner.model.layers:
        layer.forward = types.MethodType(forward, layer)
    impl.name += "+compile"


def profile(impl: Impl, batch, steps: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    impl.runner.execute(batch)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            impl.runner.execute(batch)
    print(f"--- {impl.name}: top operators by self CPU time, {steps} steps ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--baseline", default=None, help="git commit to compare with")
    p.add_argument("--baseline-bf16", action="store_true",
                   help="the baseline loads its default (bf16) weights: a commit that "
                        "predates --weights-dtype")
    p.add_argument("--weights-dtypes", default=None,
                   help="comma-separated --weights-dtype forms of this checkout to time side "
                        "by side (ratios against the first)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time a prefill step of this many question tokens")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="steps per round (median)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU time (use with --threads 1 on a shared "
                        "machine: other processes then barely move the figures)")
    p.add_argument("--compile", action="store_true",
                   help="also time each weights form with torch.compile'd layers "
                        "(compile_layers), side by side with the eager one")
    p.add_argument("--page-order", choices=["ascending", "reversed", "shuffled"],
                   default="ascending",
                   help="each decode's page ids in this order (reversed: as the allocator "
                        "hands out a fresh prompt's pages)")
    p.add_argument("--attention-only", action="store_true",
                   help="time the decode step's attention alone (plan + every layer's "
                        "K/V write and attention), not the whole step")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        p.error("--clock cpu needs --threads 1 (idle OpenMP workers would count as work)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    args.kv_tokens = args.groups * args.system + args.batch * (args.question + 32) + 64

    sys.path.insert(0, str(REPO))
    forms = args.weights_dtypes.split(",") if args.weights_dtypes else [None]
    impls = [Impl("radixserve", args, weights_dtype=w) for w in forms]
    if args.compile:
        for w in forms:
            impls.append(Impl("radixserve", args, weights_dtype=w))
            compile_layers(impls[-1])
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            # A commit before --weights-dtype (7a13837) loads bf16 only: pass no form.
            impls.insert(0, Impl(import_baseline(args.baseline, Path(tmp)), args,
                                 weights_dtype=None if args.baseline_bf16 else forms[0]))
        kinds = [("decode", "decode_batch")]
        if args.prefill_tokens:
            kinds.append(("prefill", "prefill_batch"))
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} "
              f"clock, {args.dtype}, "
              f"decode batch {args.batch} in {args.groups} groups of {args.system} shared "
              f"tokens, pages {args.page_order}"
              + (", attention only" if args.attention_only else ""))
        for kind, method in kinds:
            batches = [getattr(i, method)(args) for i in impls]
            for impl, batch in zip(impls, batches):
                t0 = time.perf_counter()
                impl.runner.execute(batch)                         # warm-up
                if args.compile:
                    print(f"{impl.name}: first step {time.perf_counter() - t0:.1f} s")
            if args.profile:
                for impl, batch in zip(impls, batches):
                    profile(impl, batch, args.steps, args.top)
                continue
            times = {i.name: [] for i in impls}
            for r in range(args.rounds):
                order = list(zip(impls, batches))
                if r % 2:
                    order.reverse()
                for impl, batch in order:
                    times[impl.name].append(impl.time_steps(
                        batch, args.steps, clock, args.attention_only and kind == "decode"))
            for name, ts in times.items():
                print(f"{kind:<8} {name:<16} ms per step by round: "
                      + " ".join(f"{t * 1e3:7.1f}" for t in ts))
            base = times[impls[0].name]
            for impl in impls[1:]:
                ratios = [b / n for b, n in zip(base, times[impl.name])]
                print(f"{kind:<8} speedup ({impls[0].name} / {impl.name}) by round: "
                      + " ".join(f"{x:.2f}" for x in ratios)
                      + f"; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
