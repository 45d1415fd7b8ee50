"""SeqSpan: one sequence's part of a step. Plain numpy, no torch, so the scheduler that
builds spans (and its tests) runs without torch; `metadata.build_metadata` reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class SeqSpan:
    """One sequence's part of a step."""

    pages: np.ndarray   # int32; covers cached_len + new_len tokens (extra ids ignored)
    cached_len: int     # tokens already in the pages before this step
    new_len: int        # tokens computed this step (>= 1)
