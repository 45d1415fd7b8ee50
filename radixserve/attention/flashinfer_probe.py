"""Start-up trial of flashinfer: one tiny plan and run on the device, before serving.

``import flashinfer`` succeeds without a CUDA toolkit: its kernels are JIT-built by the first
``plan()``, which then raises "Could not find nvcc". Only running a kernel shows whether the
backend works here, so ``create_backend`` calls ``flashinfer_trial_error`` and, under
``--attention-backend auto``, falls back to torch when it returns a reason.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.kv_sizing import KVFormat

TRIAL_PAGE_SIZE = 4
# (cached, new) tokens: one prefill over a cached prefix and one decode, so every wrapper
# the backend uses plans and runs once (and JIT-builds its kernels, if it must).
TRIAL_SPANS = ((3, 2), (5, 1))
NO_KERNELS_HINT = ("flashinfer needs nvcc or prebuilt kernels: `flashinfer download-kernels` "
                   "(or put the CUDA toolkit's nvcc on PATH)")


def explain_failure(exc: BaseException) -> str:
    """One line saying why the trial failed, with the fix where it is known."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    detail = f"{type(exc).__name__}: {first_line}"
    if "nvcc" in str(exc).lower() or "cuda_home" in str(exc).lower():
        return f"{NO_KERNELS_HINT} ({detail})"
    return f"flashinfer failed its start-up trial ({detail})"


def flashinfer_trial_error(backend, kv_format: KVFormat | None = None) -> str | None:
    """None when ``backend`` (a FlashInferBackend) planned and ran a tiny step on its device
    with finite output, else why not in one line."""
    hq, hkv, d = backend.num_qo_heads, backend.num_kv_heads, backend.head_dim
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        pool = KVPool(1, 8, TRIAL_PAGE_SIZE, hkv, d, backend.dtype, backend.device,
                      kv_format=kv_format, fixed_scale=backend.fixed_kv_scale)
        spans, first_page = [], 0
        for cached, new in TRIAL_SPANS:
            n_pages = -(-(cached + new) // TRIAL_PAGE_SIZE)
            spans.append(SeqSpan(np.arange(first_page, first_page + n_pages, dtype=np.int32),
                                 cached, new))
            first_page += n_pages
        meta = build_metadata(spans, TRIAL_PAGE_SIZE, backend.device)
        t = meta.num_tokens
        q, k, v = (torch.randn(t, h, d, generator=gen).to(backend.device, backend.dtype)
                   for h in (hq, hkv, hkv))
        out = backend.forward(backend.prepare(meta), 0, q, k, v, pool)
        if not bool(torch.isfinite(out).all()):       # a host sync: the kernel really ran
            return "flashinfer's start-up trial returned non-finite values"
    except Exception as exc:      # anything the kernels raise means: not usable here
        return explain_failure(exc)
    return None
