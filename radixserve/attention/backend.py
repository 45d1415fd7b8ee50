"""The attention backend interface and the factory that picks an implementation.

A step calls ``prepare(meta)`` once (flashinfer plans its kernels there; the torch backend
builds its gather indices) and ``forward(plan, layer, ...)`` once per layer. Each backend
names its own plan type (``AttentionBackend[TorchPlan]``), so the plan is typed end to end.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from abc import ABC, abstractmethod
from typing import Generic, Protocol, Sequence, TypeVar

import torch

from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.kv_quant import flashinfer_kv_reason, storage_dtype
from radixserve.kv_sizing import KVFormat

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "flashinfer")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


class AttentionPlan(Protocol):
    """What every backend's per-step plan carries: the page table it was made for."""

    meta: AttentionMetadata


PlanT = TypeVar("PlanT", bound=AttentionPlan)


class AttentionBackend(ABC, Generic[PlanT]):
    name: str
    # A backend that reads quantized KV with one fixed scale per tensor (flashinfer's fp8
    # path) says which; the pool then writes codes at that scale. None: per-token scales.
    fixed_kv_scale: float | None = None

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> PlanT:
        """Once per step: everything that does not depend on the layer."""

    @abstractmethod
    def forward(self, plan: PlanT, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]: write k/v at meta.write_slots, attend -> [T, Hq, D]."""


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here (no CUDA, package missing)."""


def flashinfer_import_error() -> str | None:
    """None when flashinfer imports, else why not. Only called for CUDA devices."""
    if importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not installed"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # a broken install must not take the server down under auto
        return f"flashinfer failed to import ({type(exc).__name__}: {exc})"
    return None


def flashinfer_unsupported_reason(num_qo_heads: int, num_kv_heads: int, head_dim: int,
                                  dtype: torch.dtype) -> str | None:
    """Why flashinfer's kernels cannot serve this shape/dtype, or None when they can."""
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim={head_dim} (flashinfer supports {FLASHINFER_HEAD_DIMS})"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype={dtype} (flashinfer supports float16 and bfloat16)"
    if num_qo_heads % num_kv_heads:
        return f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    return None


def deterministic_window_reason(deterministic: bool,
                                layer_windows: Sequence[int | None] | None) -> str | None:
    """Deterministic sliding windows are the fixed-split torch backend's; flashinfer's fixed
    split with window_left is not checked yet."""
    if deterministic and layer_windows is not None:
        return "deterministic mode with sliding-window layers"
    return None


def create_backend(name: str, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device: torch.device | str,
                   sm_scale: float | None = None,
                   kv_format: KVFormat | None = None,
                   deterministic: bool = False,
                   layer_windows: Sequence[int | None] | None = None,
                   logits_soft_cap: float | None = None,
                   ) -> AttentionBackend[AttentionPlan]:
    """Build "torch", "flashinfer" or "auto" (flashinfer when CUDA and the package exist and
    a tiny trial step runs on the device; else torch, with the reason logged in one line).

    ``deterministic``: the torch backend becomes ``FixedSplitBackend`` (a query's result
    never depends on the rest of the step) and flashinfer plans with a fixed KV split.

    An explicitly requested flashinfer on a machine without CUDA, without the package or
    failing the trial is an error; a shape or dtype flashinfer cannot run falls back to torch with a warning.

    ``layer_windows``: per layer, its sliding window in tokens (None: full attention).
    ``logits_soft_cap``: attention logits -> cap * tanh(logits / cap) (Gemma 2).
    """
    from radixserve.attention.torch_backend import (DEFAULT_MAX_GATHER_ELEMS,
                                                    DEFAULT_MAX_GATHER_ELEMS_LOW_PRECISION,
                                                    TorchAttentionBackend, cpu_has_amx)

    torch_backend = TorchAttentionBackend
    if deterministic:
        from radixserve.attention.fixed_split import FixedSplitBackend
        torch_backend = FixedSplitBackend
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if num_qo_heads < 1 or num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} must be a positive multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if layer_windows is not None and all(w is None for w in layer_windows):
        layer_windows = None
    if deterministic and logits_soft_cap is not None:
        raise ValueError("--deterministic does not support attention logit soft-capping "
                         "(this model sets attn_logit_softcapping)")
    device = torch.device(device)
    common = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  sm_scale=sm_scale, layer_windows=layer_windows)
    # One decision per machine: bf16/fp16 attention through SDPA's fused kernel where it runs
    # on AMX; prefills then join shared-prefix groups (as in fp32), elsewhere the blocked
    # per-span path is faster than the cascade one. bf16/fp16 chunks gather more.
    fused = cpu_has_amx()
    torch_kw = common if deterministic else dict(
        common, sdpa_low_precision=fused, cascade_prefills=dtype == torch.float32 or fused,
        max_gather_elems=DEFAULT_MAX_GATHER_ELEMS if dtype == torch.float32 else
        DEFAULT_MAX_GATHER_ELEMS_LOW_PRECISION)
    if logits_soft_cap is not None:           # deterministic mode refused it above
        torch_kw = dict(torch_kw, logits_soft_cap=logits_soft_cap)
    if name == "torch":
        return torch_backend(**torch_kw)

    if device.type != "cuda":
        if name == "flashinfer":
            raise BackendUnavailable(f"the flashinfer backend needs a CUDA device, got "
                                     f"{device}; use --attention-backend torch")
        return torch_backend(**torch_kw)
    reason = (flashinfer_unsupported_reason(num_qo_heads, num_kv_heads, head_dim, dtype)
              or flashinfer_kv_reason(kv_format, dtype)
              or deterministic_window_reason(deterministic, layer_windows))
    if reason is not None:
        msg = f"flashinfer cannot run {reason}; falling back to the torch attention backend"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return torch_backend(**torch_kw)

    import_error = flashinfer_import_error()
    if import_error is not None:
        if name == "flashinfer":
            raise BackendUnavailable(f"the flashinfer backend is unavailable: {import_error}; "
                                     "install it with: pip install flashinfer-python "
                                     "(or pip install 'radixserve[cuda]')")
        log.info("%s; using the torch attention backend", import_error)
        return torch_backend(**torch_kw)

    from radixserve.attention.flashinfer_backend import FlashInferBackend
    from radixserve.attention.flashinfer_probe import flashinfer_trial_error

    backend = FlashInferBackend(**common, dtype=dtype, device=device,
                                kv_dtype=storage_dtype(kv_format.k) if kv_format else None,
                                deterministic=deterministic, logits_soft_cap=logits_soft_cap)
    # Importing is not enough: the kernels build at the first plan() (nvcc, or prebuilt).
    trial_error = flashinfer_trial_error(backend, kv_format)
    if trial_error is None:
        return backend
    if name == "flashinfer":
        raise BackendUnavailable(f"the flashinfer backend cannot run here: {trial_error}; "
                                 "use --attention-backend torch or auto")
    log.warning("%s; using the torch attention backend", trial_error)
    return torch_backend(**torch_kw)
