#!/usr/bin/env python
"""The floor of one batch-1 decode step: the step's weight matmuls alone, back to back.

Every linear of SmolLM2-135M (fused q/k/v and gate/up as radixserve runs them, or
``--unfused`` as llama.cpp does; 30 layers and the LM head, each layer with weights of its
own so nothing stays in cache) is called in one tight loop over prepared arguments, for
every weight-only kernel torch (and torchao, when installed) offers on this CPU. No norm,
no RoPE, no attention, no sampling: whatever a whole step costs, it costs at least this.
If the fastest kernel's loop alone takes longer than llama.cpp's whole step
(``--llama-ms``, measured with scripts/bench_single_stream.py), no decode path built on
these kernels can match llama.cpp at one stream.

Rounds alternate the kernels' order (reversed every other round) so load from other
processes falls on all of them alike; each pass reports wall time and the process's CPU
time (steadier on a shared machine). The Python loop's own cost is measured with a no-op
op of the same call count and printed beside.

    python scripts/bench_kernel_floor.py --threads 2 --rounds 8 --passes 5
    python scripts/bench_kernel_floor.py --threads 1 --only int4,int8 --unfused
    python scripts/bench_kernel_floor.py --threads 1    # shared machine: CPU time, split
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Call = tuple[Callable, tuple]


@dataclass(frozen=True)
class Shapes:
    """A Llama-shaped model's linear weights [out, in] for one decode step, in call order."""

    hidden: int = 576            # SmolLM2-135M
    intermediate: int = 1536
    q_size: int = 576            # 9 heads x 64
    kv_size: int = 192           # 3 KV heads x 64
    layers: int = 30
    vocab: int = 49152

    def step(self, fused: bool) -> list[tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        if fused:
            layer = [(self.q_size + 2 * self.kv_size, h), (h, self.q_size), (2 * i, h), (h, i)]
        else:
            layer = [(self.q_size, h), (self.kv_size, h), (self.kv_size, h), (h, self.q_size),
                     (i, h), (i, h), (h, i)]
        return layer * self.layers + [(self.vocab, h)]


@dataclass
class Kernel:
    """One way of running the step's matmuls: its calls and the bytes its weights hold."""

    name: str
    calls: list[Call]
    weight_bytes: int


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def float_linear(shapes, dtype: torch.dtype) -> Kernel:
    x = torch.randn(1, shapes[0][1], dtype=dtype)
    calls, total = [], 0
    for n, k in shapes:
        w = torch.randn(n, k, dtype=dtype) * 0.02
        calls.append((F.linear, (_x(x, k), w)))
        total += _nbytes(w)
    return Kernel(f"{_short(dtype)} F.linear", calls, total)


def onednn_packed(shapes, dtype: torch.dtype) -> Kernel | None:
    """bf16 weights reordered once into oneDNN's blocked layout (radixserve's bf16 path)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and ops._is_mkldnn_bf16_supported()):
        return None
    calls, total = [], 0
    x = torch.randn(1, shapes[0][1], dtype=dtype)
    for n, k in shapes:
        w = torch.randn(n, k, dtype=dtype) * 0.02
        packed = ops._reorder_linear_weight(w, 2048)
        calls.append((ops._linear_pointwise, (_x(x, k), packed, None, "none", [], "")))
        total += _nbytes(w)
    return Kernel(f"{_short(dtype)} oneDNN packed", calls, total)


def int4_pack(shapes, act: torch.dtype, group: int | None) -> Kernel | None:
    """``_weight_int4pack_mm_for_cpu``; ``group=None``: per layer the largest group size the
    kernel takes (32..256) that divides its input width."""
    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    calls, total = [], 0
    x = torch.randn(1, shapes[0][1], dtype=act)
    for n, k in shapes:
        g = group or max(s for s in (32, 64, 128, 256) if k % s == 0)
        if k % g or n % 16:
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
        sz = (torch.rand(k // g, n, 2) * 0.01).to(act)
        calls.append((op, (_x(x, k), packed, g, sz)))
        total += _nbytes(packed, sz)
    label = f"group {group}" if group else "largest group"
    return Kernel(f"int4 pack mm, {label}, {_short(act)} act", calls, total)


def int8_pack(shapes, act: torch.dtype) -> Kernel:
    """``_weight_int8pack_mm``: int8 weights, a scale per output row."""
    calls, total = [], 0
    x = torch.randn(1, shapes[0][1], dtype=act)
    for n, k in shapes:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = (torch.rand(n) * 0.01).to(act)
        calls.append((torch.ops.aten._weight_int8pack_mm, (_x(x, k), q, scale)))
        total += _nbytes(q, scale)
    return Kernel(f"int8 pack mm, {_short(act)} act", calls, total)


def as_served(shapes) -> Kernel:
    """radixserve's ``--weights-dtype int4``: int4 group-32 linears, the int8 LM head."""
    body, head = int4_pack(shapes[:-1], torch.bfloat16, 32), int8_pack(shapes[-1:],
                                                                        torch.bfloat16)
    return Kernel("as served: int4 g32 linears + int8 head", body.calls + head.calls,
                  body.weight_bytes + head.weight_bytes)


def _int8_dynamic(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32 (``torch._int_mm``) behind a per-row quantization of ``x``: what
    llama.cpp's Q8 activations do, and torchao's Int8DynamicActivationInt8Weight."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    xq = torch.round(x / s).to(torch.int8)
    return torch._int_mm(xq, w_t).float().mul_(s).mul_(w_scale)


def int8_dynamic(shapes) -> Kernel:
    calls, total = [], 0
    x = torch.randn(1, shapes[0][1])
    for n, k in shapes:
        w_t = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
        scale = torch.rand(n) * 0.01
        calls.append((_int8_dynamic, (_x(x, k), w_t, scale)))
        total += _nbytes(w_t, scale)
    return Kernel("int8 x int8 _int_mm (dynamic act, 4 ops)", calls, total)


def torchao_kernels(shapes) -> list[Kernel]:
    """torchao's CPU configs, through the modules ``quantize_`` makes (tensor-subclass
    dispatch in Python included: that is how torchao runs them)."""
    try:
        import torchao.quantization as tq
        from torchao.prototype.quantization import int4 as tq4
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        print("torchao not installed: its configs skipped")
        return []
    configs = {
        # CPU int4 moved to the prototype (Int4OpaqueTensor: _weight_int4pack_mm_for_cpu)
        "torchao PrototypeInt4WeightOnly g32": lambda: tq4.PrototypeInt4WeightOnlyConfig(
            group_size=32),
        "torchao Int8DynActInt4Weight g32": lambda: tq4.Int8DynamicActivationInt4WeightConfig(
            group_size=32),
        "torchao Int8WeightOnly": tq.Int8WeightOnlyConfig,
        "torchao Int8DynActInt8Weight": tq.Int8DynamicActivationInt8WeightConfig,
        "torchao IntxWeightOnly int4 g32": lambda: tq.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(32)),
    }
    out = []
    for name, make in configs.items():
        try:
            mods = [torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16) for n, k in shapes]
            seq = torch.nn.Sequential(*mods)
            tq.quantize_(seq, make())
            x = torch.randn(1, shapes[0][1], dtype=torch.bfloat16)
            calls = [(m, (_x(x, k),)) for m, (n, k) in zip(seq, shapes)]
            for fn, args in calls[:8]:
                fn(*args)
            nbytes = sum(_nbytes(*_plain_tensors(m.weight)) for m in seq)
            out.append(Kernel(name, calls, nbytes))
        except Exception as e:  # noqa: BLE001 - a config this CPU or version cannot run
            print(f"{name}: not runnable here ({type(e).__name__}: {str(e)[:120]})")
    return out


def _plain_tensors(w: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside a torchao tensor subclass (its own storage)."""
    if type(w) is torch.Tensor or isinstance(w, torch.nn.Parameter) and \
            type(w.data) is torch.Tensor:
        return [w]
    names, _ = w.__tensor_flatten__()
    return [t for n in names for t in _plain_tensors(getattr(w, n))]


def noop_loop(shapes) -> Kernel:
    """The loop's own cost: one trivial op per call (a view of the input)."""
    x = torch.randn(1, shapes[0][1])
    return Kernel("(loop + dispatch only: aten.alias)",
                  [(torch.ops.aten.alias, (x,)) for _ in shapes], 0)


def _x(x: torch.Tensor, k: int) -> torch.Tensor:
    """An activation row of width ``k`` in ``x``'s dtype (one per call: a few KiB each)."""
    return torch.randn(1, k, dtype=x.dtype)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def run_pass(calls: list[Call]) -> None:
    for fn, args in calls:
        fn(*args)


def build(args, shapes) -> list[Kernel]:
    want = args.only.split(",") if args.only else None
    groups: list[Kernel | None] = [noop_loop(shapes)]
    if not want or "float" in want:
        groups += [float_linear(shapes, torch.float32), float_linear(shapes, torch.bfloat16),
                   onednn_packed(shapes, torch.bfloat16)]
    if not want or "int8" in want:
        groups += [int8_pack(shapes, torch.bfloat16), int8_pack(shapes, torch.float32),
                   int8_pack(shapes, torch.float16), int8_dynamic(shapes)]
    if not want or "int4" in want:
        for g in (32, 64, 128, 256):
            k = int4_pack(shapes, torch.bfloat16, g)
            if k is None:
                print(f"int4 group {g}: refused by the kernel at these shapes (an input "
                      f"width is not a multiple of {g})")
            groups.append(k)
        groups += [int4_pack(shapes, torch.bfloat16, None),
                   int4_pack(shapes, torch.float32, 32), int4_pack(shapes, torch.float16, 32)]
    if not want or "int4" in want and "int8" in want:
        groups.append(as_served(shapes))
    if not want or "torchao" in want:
        groups += torchao_kernels(shapes)
    return [k for k in groups if k is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--passes", type=int, default=5, help="passes per kernel per round")
    p.add_argument("--unfused", action="store_true",
                   help="q, k, v and gate, up as separate matmuls (llama.cpp's calls)")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of float,int8,int4,torchao")
    p.add_argument("--llama-ms", type=float, default=12.4,
                   help="llama.cpp's whole decode step on this machine, ms (idle, 2 threads, "
                        "scripts/bench_single_stream.py)")
    p.add_argument("--cores", type=int, default=2,
                   help="with --threads 1: the cores llama.cpp's figure used (perfect split)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes = Shapes().step(fused=not args.unfused)
    with torch.inference_mode():
        kernels = build(args, shapes)
        for k in kernels:                       # warm-up: page the weights in, pick kernels
            run_pass(k.calls)
        wall = {k.name: [] for k in kernels}
        cpu = {k.name: [] for k in kernels}
        for r in range(args.rounds):
            order = kernels if r % 2 == 0 else kernels[::-1]
            for k in order:
                for _ in range(args.passes):
                    t0, c0 = time.perf_counter(), time.process_time()
                    run_pass(k.calls)
                    wall[k.name].append(time.perf_counter() - t0)
                    cpu[k.name].append(time.process_time() - c0)
    print(f"torch {torch.__version__}, {args.threads} threads, {len(shapes)} matmuls per step "
          f"({'unfused' if args.unfused else 'fused q/k/v and gate/up'}), batch 1, "
          f"{args.rounds} rounds x {args.passes} passes")
    print(f"{'kernel':<44} {'weights MiB':>11} {'wall min':>9} {'wall med':>9} "
          f"{'cpu med':>8} {'GB/s@min':>9}   (ms per step)")
    for k in sorted(kernels, key=lambda k: min(wall[k.name])):
        lo, med = min(wall[k.name]), statistics.median(wall[k.name])
        rate = f"{k.weight_bytes / lo / 1e9:9.1f}" if k.weight_bytes else f"{'':>9}"
        print(f"{k.name:<44} {k.weight_bytes / 2**20:11.1f} {lo * 1e3:9.2f} {med * 1e3:9.2f} "
              f"{statistics.median(cpu[k.name]) * 1e3:8.2f} {rate}")
    real = [k for k in kernels if k.weight_bytes]
    if args.threads == 1:
        # One thread's CPU time split perfectly over the cores llama.cpp used: a bound no
        # thread count can beat, and steady on a shared machine (CPU time, not wall).
        best = min(real, key=lambda k: statistics.median(cpu[k.name]))
        cpu_ms = statistics.median(cpu[best.name]) * 1e3
        split = cpu_ms / args.cores
        print(f"fastest (CPU time, one thread): {best.name}, {cpu_ms:.2f} ms; split perfectly "
              f"over {args.cores} cores: {split:.2f} ms = {split / args.llama_ms:.2f}x "
              f"llama.cpp's whole step ({args.llama_ms} ms)")
        return
    best = min(real, key=lambda k: min(wall[k.name]))
    best_ms = min(wall[best.name]) * 1e3
    verdict = "longer than" if best_ms > args.llama_ms else "within"
    print(f"fastest: {best.name}, {best_ms:.2f} ms for the matmuls alone (best pass): "
          f"{best_ms / args.llama_ms:.2f}x llama.cpp's whole step ({args.llama_ms} ms), "
          f"{verdict} it")

if __name__ == "__main__":
    main()
