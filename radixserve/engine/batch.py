"""StepBatch: everything one forward pass needs, built by the scheduler, read by the runner.

It is a snapshot: the scheduler may change its sequences after the step, never the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.attention.metadata import SeqSpan
from radixserve.cache.prefix_lease import CopyOrder
from radixserve.engine.sampling_params import SamplingParams


@dataclass
class StepBatch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)      # prefill spans first
    sample_rows: list[int] = field(default_factory=list)    # span index -> needs a token
    sample_params: list[SamplingParams] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    copies: list[CopyOrder] = field(default_factory=list)   # copy-on-write, before the forward

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def __bool__(self) -> bool:
        return bool(self.spans)
