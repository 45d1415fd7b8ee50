"""The floor a workload cannot beat on a machine: FLOPs over the GEMM peak, bytes over the
memory bandwidth (a roofline), for a Llama-family model. Pure arithmetic, no torch.

Counted work (the rest — norms, RoPE, sampling, Python — is what the floor leaves out):
- linear layers: 2 FLOPs per weight per token; the LM head only for tokens that are sampled;
- attention: 4 * heads * head_dim FLOPs per (query, visible key) pair (QK^T and PV);
- a decode step reads every linear weight (and the LM head) once and every K/V byte of the
  batch's contexts once; a prefix shared by several sequences (the same pages) once per step.

A step's floor is max(compute time, memory time); a workload's is the sum over its steps.
`scripts/roofline.py` measures the peaks (`radixserve.perf.probe`) and prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["MachinePeaks", "ModelShape", "SharedPromptWorkload", "StepCost", "WorkloadFloor",
           "attention_flops", "cache_on_and_off", "weighted_gflops", "workload_floor"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the floor needs of a model (see ModelShape.of for a ModelConfig)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """From a `radixserve.model.ModelConfig` (or anything with its field names)."""
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's linears: q/k/v, o, gate/up, down."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    @property
    def body_weights(self) -> int:
        return self.num_layers * self.layer_weights

    @property
    def head_weights(self) -> int:
        return self.vocab_size * self.hidden_size

    def linear_flops(self, tokens: int, sampled: int) -> float:
        """FLOPs of every linear for ``tokens`` tokens, ``sampled`` of them through the head."""
        return 2.0 * (tokens * self.body_weights + sampled * self.head_weights)

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        """K and V of one token in every layer, ``kv_bytes`` per element."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes

    def gemm_shapes(self) -> dict[str, tuple[int, int]]:
        """(K, N) of each GEMM of a layer, and of the LM head."""
        h, q = self.hidden_size, self.num_heads * self.head_dim
        return {"qkv": (h, q + 2 * self.num_kv_heads * self.head_dim), "o": (q, h),
                "gate_up": (h, 2 * self.intermediate_size),
                "down": (self.intermediate_size, h), "lm_head": (h, self.vocab_size)}


def attention_flops(shape: ModelShape, new_tokens: int, context: int) -> float:
    """Causal attention of ``new_tokens`` queries appended after ``context - new_tokens``
    cached ones: query i (0-based) sees ``context - new_tokens + i + 1`` keys."""
    cached = context - new_tokens
    pairs = new_tokens * cached + new_tokens * (new_tokens + 1) / 2
    return 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * pairs


@dataclass(frozen=True, slots=True)
class MachinePeaks:
    """Measured rates: GEMM GFLOP/s for decode-sized and prefill-sized batches, GB/s read."""

    decode_gflops: float
    prefill_gflops: float
    bandwidth_gbs: float


@dataclass(slots=True)
class StepCost:
    flops: float = 0.0
    bytes: float = 0.0

    def seconds(self, gflops: float, gbs: float) -> float:
        return max(self.flops / (gflops * 1e9), self.bytes / (gbs * 1e9))


@dataclass(frozen=True, slots=True)
class SharedPromptWorkload:
    """``groups`` x ``per_group`` requests: a ``system``-token prompt per group, then a
    ``question`` of their own; ``output`` tokens each, all decoded together."""

    groups: int
    per_group: int
    system: int
    question: int
    output: int
    cache: bool = True          # False: every request computes its system prompt itself

    @property
    def requests(self) -> int:
        return self.groups * self.per_group


@dataclass(slots=True)
class WorkloadFloor:
    prefill: StepCost = field(default_factory=StepCost)
    decode_steps: list[StepCost] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def _prefill_cost(shape: ModelShape, w: SharedPromptWorkload) -> StepCost:
    n, L = w.requests, w.system + w.question
    if w.cache:   # each system prompt once; each question after its cached prompt
        tokens = w.groups * w.system + n * w.question
        attn = (w.groups * attention_flops(shape, w.system, w.system)
                + n * attention_flops(shape, w.question, L))
    else:
        tokens = n * L
        attn = n * attention_flops(shape, L, L)
    return StepCost(flops=shape.linear_flops(tokens, n) + attn)


def _decode_costs(shape: ModelShape, w: SharedPromptWorkload, weight_bytes: float,
                  kv_bytes: float) -> list[StepCost]:
    """The output - 1 decode steps of all requests together (the first token comes from
    the prefill). Shared system prompts are read once per group with the cache on."""
    n, L = w.requests, w.system + w.question
    per_token = shape.kv_bytes_per_token(kv_bytes)
    weights = (shape.body_weights + shape.head_weights) * weight_bytes
    steps = []
    for s in range(1, w.output):
        context = L + s                        # keys each decode sees (its own included)
        if w.cache:
            read_tokens = w.groups * w.system + n * (context - w.system)
        else:
            read_tokens = n * context
        steps.append(StepCost(
            flops=shape.linear_flops(n, n) + n * attention_flops(shape, 1, context),
            bytes=weights + read_tokens * per_token))
    return steps


def workload_floor(shape: ModelShape, peaks: MachinePeaks, w: SharedPromptWorkload,
                   weight_bytes: float = 2, kv_bytes: float = 2) -> WorkloadFloor:
    """Prefill floor (compute-bound: FLOPs at the prefill peak) + decode floor (per step,
    the larger of FLOPs at the decode peak and bytes at the bandwidth)."""
    floor = WorkloadFloor(prefill=_prefill_cost(shape, w),
                          decode_steps=_decode_costs(shape, w, weight_bytes, kv_bytes))
    floor.prefill_s = floor.prefill.seconds(peaks.prefill_gflops, peaks.bandwidth_gbs)
    floor.decode_s = sum(s.seconds(peaks.decode_gflops, peaks.bandwidth_gbs)
                         for s in floor.decode_steps)
    return floor


def cache_on_and_off(shape: ModelShape, peaks: MachinePeaks, groups: int, per_group: int,
                     system: int, question: int, output: int,
                     dtype_bytes: float = 2) -> dict[str, WorkloadFloor]:
    """The shared-prompt workload's floor with the radix cache "on" and "off"."""
    return {("on" if cache else "off"): workload_floor(
                shape, peaks, SharedPromptWorkload(groups, per_group, system, question, output,
                                                   cache=cache),
                weight_bytes=dtype_bytes, kv_bytes=dtype_bytes)
            for cache in (True, False)}


def weighted_gflops(rates: Sequence[tuple[float, float]]) -> float:
    """Aggregate rate of GEMMs given as (flops, GFLOP/s): total flops over total time."""
    flops = sum(f for f, _ in rates)
    seconds = sum(f / (r * 1e9) for f, r in rates)
    return flops / seconds / 1e9
