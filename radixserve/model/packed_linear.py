"""nn.Linear whose weight is also kept pre-packed for oneDNN: the CPU bf16/fp16 fast path.

On CPU, torch runs a bf16 ``F.linear`` through oneDNN and reorders the weight into the
kernel's blocked layout on every call. Streaming a layer's weights is what a decode step is
made of, so that reorder is most of a small-batch GEMM's cost: packing once (oneDNN's own
layout, an opaque mkldnn tensor beside the parameter) took the gate/up GEMM at 64 tokens
from 721 to 457 us with cold weights, one-token GEMMs from 616 to 157 us. Up to 32 rows it
gives the same bits as ``F.linear``; above, a different kernel rounds differently (1 ulp).

The parameter itself stays what loaders, the weights cache and ``state_dict`` see; the
packed copy is derived from it by ``repack()`` (LlamaForCausalLM.pack_weights after every
load), and a weight changed afterwards is noticed by its version counter and repacked.
fp32 and non-CPU tensors never pack (fp32 keeps MKL's sgemm, which matches transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "packing_available"]

_PACKED_DTYPES = (torch.bfloat16, torch.float16)
# oneDNN picks its blocking from this batch hint. Measured (gate/up, one thread, CPU time,
# us at M = 1 / 64 / 512 / 2,048): F.linear 529 / 794 / 2,008 / 5,852; hint 1: 231 / 610 /
# 2,520 / 8,907; hint 2,048: 244 / 544 / 1,680 / 6,085. So hint 2,048, and batches above
# _MAX_PACKED_ROWS (prefill chunks, where packing gains nothing) keep F.linear.
_BATCH_HINT = 2048
_MAX_PACKED_ROWS = 1024


def packing_available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can run pre-packed: a CPU bf16/fp16 tensor, with oneDNN present
    and supporting that dtype on this CPU."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
        return False
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    supported = (ops._is_mkldnn_bf16_supported if weight.dtype == torch.bfloat16
                 else ops._is_mkldnn_fp16_supported)
    return bool(supported())


class Linear(nn.Linear):
    """An nn.Linear (same parameters, same names) that uses a packed weight when it has one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple[torch.Tensor, int] | None = None   # (source, its version)

    @torch.no_grad()
    def repack(self) -> bool:
        """Pack the current weight if packing applies; drop a stale packed copy otherwise."""
        w = self.weight
        self._packed = self._packed_from = None
        if w.is_meta or not packing_available(w):
            return False
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _BATCH_HINT)
        self._packed_from = (w, w._version)
        return True

    def _fresh(self) -> bool:
        source, version = self._packed_from
        return source is self.weight and version == source._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._packed is not None and x.dtype == self._packed.dtype
                and x.device.type == "cpu" and x.numel() <= _MAX_PACKED_ROWS * x.shape[-1]
                and self._fresh()):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none",
                                                      [], "")
        return F.linear(x, self.weight, self.bias)
