"""Named scratch tensors reused across chunks, layers and steps.

On CPU a fresh multi-MB temporary is mapped anew by the allocator on every use (glibc trims
the freed heap top), and its page faults cost as much as the arithmetic done in it: a cascade
prefill of 2,048 queries over a 1,024-token prefix faulted 8,300 pages (~10 ms) per layer
before its temporaries came from here. Steps run one at a time, so one owner (a backend)
holds one workspace; a name must not be taken again while an earlier tensor under the same
name is still in use.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (uninitialised), reusing ``name``'s storage."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
