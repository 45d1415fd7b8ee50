"""A linear layer held twice, quantized (int4; int8 for the LM head) and float, each used at
the row counts where it is faster (``--weights-dtype int4+float``).

Why: on a CPU without native bf16 (where ``--dtype auto`` picks float32), the int4 kernel
computes in bf16 that the CPU emulates, so its cost grows with the rows: it reads 8x fewer
bytes than fp32 weights and wins while a step streams weights (one to a few sequences), but
loses to fp32 ``F.linear`` (MKL sgemm) from a few dozen rows on (one thread, CPU time, hot
weights, SmolLM2's gate/up 3072x576: int4 138 / 509 / 1,836 us at 1 / 8 / 32 rows, fp32 283
/ 784 / 1,238 us). Keeping both forms costs the quantized bytes on top of the float ones
(SmolLM2 in float32: 1.18x the float bytes) and makes no step slower than float weights.

The float form is the model's own linear (the same module, parameters and names: loaders,
the weights cache and tied embeddings see what they saw before); rows above
``max_quantized_rows`` give exactly the float model's results. Deterministic mode needs a
row's result not to depend on the step's other rows, so it takes the quantized form alone
(``row_invariant_form``: the kernels are row-invariant). The LM head's quantized form is
int8 (per-row scales), as in ``int4``: with an int4 head (re-quantized from the float
table) greedy agreement with the fp32 reference was 4.5 tokens of 16, against 15.0 for
``int4`` (scripts/bench_weights.py, 8 prompts).
"""

from __future__ import annotations

import torch
from torch import nn


__all__ = ["DEFAULT_MAX_QUANTIZED_ROWS", "DualLinear"]

# Rows up to which the quantized kernel runs. Chosen from SmolLM2's float32 decode step, CPU
# time, int4 against fp32 weights (scripts/bench_decode_step.py --weights-dtypes
# bf16,int4,int4+float --batch N; docs/benchmarks.md, "int4 at 32+ rows"): 1.70x at 1
# sequence, 1.62x at 8, 1.16x at 16, 0.89x at 32.
DEFAULT_MAX_QUANTIZED_ROWS = 16


class DualLinear(nn.Module):
    """``quantized`` (an Int4Linear or Int8Linear) for inputs of at most
    ``max_quantized_rows`` rows, ``dense`` (the float linear) above."""

    def __init__(self, quantized: nn.Module, dense: nn.Linear,
                 max_quantized_rows: int = DEFAULT_MAX_QUANTIZED_ROWS) -> None:
        super().__init__()
        self.quantized, self.dense = quantized, dense
        self.max_quantized_rows = max_quantized_rows

    @property
    def weight(self) -> torch.Tensor:
        """The float weight (for code that reads a linear's dtype or shape)."""
        return self.dense.weight

    @property
    def in_features(self) -> int:
        return self.dense.in_features

    @property
    def out_features(self) -> int:
        return self.dense.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.quantized(x) if rows <= self.max_quantized_rows else self.dense(x)

    def row_invariant_form(self) -> nn.Module:
        """The form deterministic mode uses: the quantized one at every row count."""
        return self.quantized

    def extra_repr(self) -> str:
        return f"max_quantized_rows={self.max_quantized_rows}"
