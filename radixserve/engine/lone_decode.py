"""Whether a step is a lone decode (one sequence, one new token) and the compiled step's
inputs for it: the token, its position, the slots of the sequence's cached tokens and the
slot its K/V go to (model/compiled_decode.py)."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.engine.batch import StepBatch


def lone_decode_inputs(batch: StepBatch, page_size: int,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(token [1], position [1], cached slots [cached_len], new slot [1]) as int64, or None
    when the step is anything else (several sequences, a prefill, no cached token, or its
    row not sampled)."""
    if len(batch.spans) != 1 or batch.sample_rows != [0]:
        return None
    span = batch.spans[0]
    if span.new_len != 1 or span.cached_len < 1:
        return None
    pos = np.arange(span.cached_len + 1, dtype=np.int64)
    slots = span.pages[pos // page_size].astype(np.int64) * page_size + pos % page_size
    return (torch.tensor(batch.input_ids, dtype=torch.int64),
            torch.tensor(batch.positions, dtype=torch.int64),
            torch.from_numpy(slots[:-1]), torch.from_numpy(slots[-1:]))
