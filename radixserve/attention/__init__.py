"""Paged attention: the step's page table (metadata) and the backends that read it.

Names are imported on first use (PEP 562), so `radixserve.attention.spans`, which the
scheduler needs, imports without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AttentionBackend": "radixserve.attention.backend",
    "BackendUnavailable": "radixserve.attention.backend",
    "create_backend": "radixserve.attention.backend",
    "AttentionMetadata": "radixserve.attention.metadata",
    "build_metadata": "radixserve.attention.metadata",
    "SeqSpan": "radixserve.attention.spans",
    "TorchAttentionBackend": "radixserve.attention.torch_backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixserve.attention' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
