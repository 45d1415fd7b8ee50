#!/usr/bin/env python
"""The ideal eager decode step: what a batch-1 token costs in eager torch at the least.

SmolLM2-135M's whole decode step written as the shortest op sequence eager torch allows,
in one plain Python loop over prepared tensors: per layer ``F.rms_norm``, the fused q/k/v
int4 matmul, RoPE in place on q and k, the new K/V copied into a contiguous cache, attention
over the first N cached tokens (two matmuls and a softmax, no gather, no page table), the
o_proj matmul and residual add, ``F.rms_norm``, the gate/up matmul, silu * up, the down
matmul and residual add; then the final norm and the int8 LM head. No scheduler, no
sampling, no modules, no plans, weights random in the served formats (int4 group 32 as
``--weights-dtype int4`` serves them, int8 head): the kernels' speed does not depend on
the values. Activations are fp32 cast to bf16 around each kernel (as served on a CPU
without native bf16) or bf16 throughout (``bf16 act``).

If this loop is slower than llama.cpp's own token on the same machine, no eager-torch
decode path can reach 1.0x: what is left needs a compiled step (``--compile`` times the
same step under ``torch.compile``, attention included since the cache is contiguous).

Every configuration (threads x context x activations) is timed in alternating rounds,
wall and process CPU time per token. ``--llama-server PATH`` also measures llama.cpp's
``llama-server`` on the same GGUF in the same run (one slot, each thread count): its
streamed decode wall per token and its CPU per decoded token (scripts/bench_single_stream).
Takes ~1-2 min (plus ~1 min per compiled configuration).

    python scripts/bench_ideal_step.py --threads 1,2 --contexts 128,512,2048 \
        --llama-server /work/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel_floor import Shapes  # noqa: E402

GROUP = 32
EPS = 1e-5
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@dataclass
class LayerWeights:
    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor]         # (packed int4, scale_zeros)
    o: tuple[torch.Tensor, torch.Tensor]
    gate_up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    k_cache: torch.Tensor                           # [Hkv, N, D] contiguous
    v_cache: torch.Tensor


def int4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
    return packed, (torch.rand(k // GROUP, n, 2) * 0.01).to(torch.bfloat16)


class IdealStep:
    """The step's tensors for one context length and activation dtype."""

    def __init__(self, shapes: Shapes, context: int, act: torch.dtype) -> None:
        h, i = shapes.hidden, shapes.intermediate
        self.act, self.context, self.hidden = act, context, h
        self.layers = [LayerWeights(
            norm1=torch.rand(h, dtype=act) + 0.5, norm2=torch.rand(h, dtype=act) + 0.5,
            qkv=int4_weight(shapes.q_size + 2 * shapes.kv_size, h),
            o=int4_weight(h, shapes.q_size), gate_up=int4_weight(2 * i, h),
            down=int4_weight(h, i),
            k_cache=torch.randn(KV_HEADS, context, HEAD_DIM, dtype=act),
            v_cache=torch.randn(KV_HEADS, context, HEAD_DIM, dtype=act))
            for _ in range(shapes.layers)]
        self.final_norm = torch.rand(h, dtype=act) + 0.5
        self.head_q = torch.randint(-127, 128, (shapes.vocab, h), dtype=torch.int8)
        self.head_scale = torch.rand(shapes.vocab, dtype=torch.bfloat16) * 0.01
        angles = torch.rand(1, 1, HEAD_DIM // 2) * 6.28
        self.cos, self.sin = angles.cos().to(act), angles.sin().to(act)
        self.x = torch.randn(1, h, dtype=act) * 0.1
        self.scale = HEAD_DIM ** -0.5

    def mm(self, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.act == torch.bfloat16:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1])
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), w[0], GROUP, w[1]).to(self.act)

    def layer(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        hn = F.rms_norm(x, (self.hidden,), w.norm1, EPS)
        qkv = self.mm(hn, w.qkv)
        qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(HEADS + KV_HEADS, HEAD_DIM)
        x1, x2 = qk.chunk(2, dim=-1)
        x1_sin, x2_sin = x1 * self.sin[0], x2 * self.sin[0]
        x1.mul_(self.cos[0]).sub_(x2_sin)
        x2.mul_(self.cos[0]).add_(x1_sin)
        kv = qkv[:, HEADS * HEAD_DIM:].view(2, KV_HEADS, HEAD_DIM)
        last = self.context - 1                    # the new token's slot: the cache stays N
        w.k_cache[:, last].copy_(kv[0])
        w.v_cache[:, last].copy_(kv[1])
        q = qk[:HEADS].view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        scores = torch.matmul(q, w.k_cache.transpose(1, 2)).mul_(self.scale)
        o = torch.matmul(scores.softmax(-1), w.v_cache)
        x = x + self.mm(o.view(1, -1), w.o)
        gate, up = self.mm(F.rms_norm(x, (self.hidden,), w.norm2, EPS), w.gate_up).chunk(2, -1)
        return x + self.mm(F.silu(gate).mul_(up), w.down)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.layers:
            x = self.layer(x, w)
        h = F.rms_norm(x, (self.hidden,), self.final_norm, EPS).to(torch.bfloat16)
        return torch.ops.aten._weight_int8pack_mm(h, self.head_q, self.head_scale)


@dataclass
class Config:
    name: str
    threads: int
    run: object          # () -> None: one step


def configs(args) -> list[Config]:
    shapes = Shapes()
    out = []
    acts = {"fp32 act": torch.float32, "bf16 act": torch.bfloat16}
    for n in map(int, args.contexts.split(",")):
        for label, act in acts.items():
            ideal = IdealStep(shapes, n, act)
            for t in map(int, args.threads.split(",")):
                out.append(Config(f"ideal eager, {label}, N={n}", t,
                                  lambda s=ideal: s.step(s.x)))
            if args.compile:
                compiled = torch.compile(ideal.layer, dynamic=False)

                def run(s=ideal, c=compiled):
                    x = s.x
                    for w in s.layers:
                        x = c(x, w)
                    return x
                for t in map(int, args.threads.split(",")):
                    out.append(Config(f"ideal compiled, {label}, N={n}", t, run))
    return out


def time_configs(cfgs: list[Config], rounds: int, steps: int) -> dict[str, tuple]:
    key = lambda c: (c.name, c.threads)  # noqa: E731
    wall = {key(c): [] for c in cfgs}
    cpu = {key(c): [] for c in cfgs}
    with torch.inference_mode():
        for c in cfgs:                                  # warm-up (and compile)
            torch.set_num_threads(c.threads)
            t0 = time.perf_counter()
            c.run()
            c.run()
            if "compiled" in c.name:
                print(f"{c.name}, {c.threads} threads: first steps "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(rounds):
            for c in (cfgs if r % 2 == 0 else cfgs[::-1]):
                torch.set_num_threads(c.threads)
                for _ in range(steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    c.run()
                    wall[key(c)].append(time.perf_counter() - t0)
                    cpu[key(c)].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in wall}


def llama_cpp(args, threads: int) -> tuple[float, float]:
    """llama-server on the same GGUF: (wall ms per streamed token, CPU ms per token)."""
    from bench_single_stream import cpu_per_token, start, stop_server, stream
    from bench_startup import free_port
    from radixserve.model.registry import resolve_model_path
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start([args.llama_server, "-m", str(resolve_model_path(args.model)), "--port",
                  str(port), "-t", str(threads), "-np", "1", "-c", "4096"], url, 600)
    try:
        stream(url, args.model, 4)
        rates = [stream(url, args.model, 128)[1] for _ in range(args.llama_repeats)]
        ns = argparse.Namespace(output_tokens="128", repeats=args.llama_repeats,
                                model=args.model)
        return 1e3 / statistics.median(rates), cpu_per_token(proc, url, ns) * 1e3
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--contexts", default="128,512,2048", help="cached tokens N attended")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="steps per configuration per round")
    p.add_argument("--compile", action="store_true",
                   help="also time the same layer under torch.compile (inductor)")
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    p.add_argument("--llama-repeats", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args()
    llama = {}
    if args.llama_server:
        for t in map(int, args.threads.split(",")):
            llama[t] = llama_cpp(args, t)
            print(f"llama.cpp, {t} threads: {llama[t][0]:.2f} ms wall per streamed token "
                  f"(128 tokens after a ~30-token prompt), {llama[t][1]:.2f} ms CPU per "
                  f"decoded token", flush=True)
    results = time_configs(configs(args), args.rounds, args.steps)
    print(f"\ntorch {torch.__version__}; medians of {args.rounds} rounds x {args.steps} steps"
          "; CPU = process time (with 2 threads it counts both threads)")
    print("| step | threads | wall ms per token | CPU ms per token | llama.cpp wall ms "
          "| ideal wall / llama wall |")
    print("|---|---|---|---|---|---|")
    for (name, t), (w, c) in results.items():
        lw = llama.get(t)
        ref = f"{lw[0]:.2f} | {w * 1e3 / lw[0]:.2f}x" if lw else "- | -"
        print(f"| {name} | {t} | {w * 1e3:.2f} | {c * 1e3:.2f} | {ref} |")


if __name__ == "__main__":
    main()
