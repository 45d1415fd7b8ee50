"""What goes into one forward pass and what comes out of it.

`StepBatch` is built by the scheduler and read by the runner on the compute thread. It is a
snapshot: the scheduler may change its sequences after the step, never the batch.
`SampleResult` is what the runner returns; `StepUpdate` is what the scheduler reports once
it has applied a result, for the output processor. No torch here (only in type hints), so
the scheduler imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.attention.spans import SeqSpan
from radixserve.cache.prefix_lease import CopyOrder
from radixserve.cache.tier_types import MoveTimes
from radixserve.cache.tiers import DemoteOrder, LoadOrder
from radixserve.engine.outputs import TokenLogprob
from radixserve.engine.peer_share import PeerOrders
from radixserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from radixserve.engine.grammar import Matcher
    from radixserve.engine.request import SeqState


@dataclass
class StepBatch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)      # prefill spans first
    sample_rows: list[int] = field(default_factory=list)    # span index -> needs a token
    sample_params: list[SamplingParams] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    copies: list[CopyOrder] = field(default_factory=list)   # copy-on-write, before the forward
    moves: list[DemoteOrder | LoadOrder] = field(default_factory=list)  # tiers: run first,
                                                            #   in this order
    matchers: list[Matcher | None] = field(default_factory=list)    # per sampled row: grammar
    peer: PeerOrders | None = None      # --kv-share: publishes first, loads after `moves`

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def __bool__(self) -> bool:
        """Anything to run: spans to compute, or tier moves alone."""
        return bool(self.spans) or bool(self.moves) or bool(self.peer)


@dataclass(slots=True)
class SampleResult:
    """One token per sampled row of the batch, in `sample_rows` order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]   # None where params.logprobs is None


@dataclass(slots=True)
class StepResult:
    """What the runner returns for one step: the samples, what the step's tier moves
    moved and took, and the seconds of the forward pass and sampling (the load-or-compute
    costs are fed from these: engine/tier_runtime.py)."""

    sample: SampleResult
    moves: MoveTimes = field(default_factory=MoveTimes)
    forward_seconds: float = 0.0


@dataclass(slots=True)
class StepUpdate:
    """What a completed step changed, for the output processor.

    The sampled tokens are three parallel lists, not one object per token: a step of 256
    decodes would spend ~0.1 ms just constructing them (issue 11's step-time regression).
    """

    seqs: list[SeqState] = field(default_factory=list)      # each got one new token
    tokens: list[int] = field(default_factory=list)         # the token appended to seqs[i]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    aborted: list[SeqState] = field(default_factory=list)   # retired: request aborted
