"""Requests and their sequences: the state the scheduler keeps for each running sample.

A `Request` is what a caller submitted (one prompt, `n` samples); each sample is a
`SeqState` that the scheduler admits, computes, preempts and retires on its own. All of
this state lives on the event-loop thread. Nothing here imports torch, so the scheduler and
its tests run without it.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.token_keys import new_token_array
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from radixserve.engine.peer_lookup import ShareTicket

    from radixserve.engine.grammar import Matcher
    from radixserve.cache.miss_reasons import MissReport

NO_PAGES = np.zeros(0, dtype=np.int32)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One submitted prompt; owns the output channel shared by its samples."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None
    emit: Callable[[RequestOutput], None]
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_step: int = 0
    sequences: list["SeqState"] = field(default_factory=list)
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.sequences)


@dataclass(eq=False)
class SeqState:
    """One sample of a request: its tokens, its pages and its place in the schedule.

    Pages: `lease` (a cache PrefixLease, None while waiting) holds them: `pages[:num_tree_pages]`
    belong to the radix tree (kept alive by the lease's lock); the rest are this sequence's
    private pages. KV is computed for
    `token_ids[:num_computed]`; a step computes `token_ids[num_computed:...]`, and when it
    reaches the end of `token_ids` the last position's logits give the next token. The ids
    are an `array('q')`, the radix tree's packed key layout (cache/token_keys.py), so every
    match and insert copies them with one memcpy instead of converting a list.
    """

    request: Request
    index: int
    token_ids: array
    generator: "torch.Generator | None"     # seeded sampling; None: the global generator
    page_size: int = 1
    status: SeqStatus = SeqStatus.WAITING
    lease: PrefixLease | None = None
    num_computed: int = 0
    prompt_cache_hit: int | None = None    # prompt tokens served from the prefix cache at
                                           # first admission (usage); None before it
    num_generated: int = 0
    preemptions: int = 0
    matcher: "Matcher | None" = None        # constrained decoding (engine/grammar.py)
    miss: "MissReport | None" = None       # why the prompt was not all cached (first admission)
    waiting_since: int = 0                 # scheduler step its wait began (lpm's wait bound)
    shared: bool = False                    # --kv-share: its prompt's pages were published
    share: "ShareTicket | None" = None      # --kv-share: its lookups, wait and claims

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.remaining > 1

    @property
    def pages(self) -> np.ndarray:
        return self.lease.pages if self.lease is not None else NO_PAGES

    @property
    def num_tree_pages(self) -> int:
        return self.lease.num_tree_pages if self.lease is not None else 0

    @property
    def private_pages(self) -> np.ndarray:
        return self.lease.private_pages if self.lease is not None else NO_PAGES


def new_request(request_id: str, prompt_ids: list[int], params: SamplingParams,
                namespace: str | None, emit: Callable[[RequestOutput], None], page_size: int,
                generators: "Sequence[torch.Generator | None] | None" = None,
                arrival_time: float | None = None) -> Request:
    """A request with its `params.n` samples (sample i samples with generators[i])."""
    request = Request(request_id, prompt_ids, params, namespace, emit)
    if arrival_time is not None:
        request.arrival_time = arrival_time
    gens = generators if generators is not None else [None] * params.n
    request.sequences = [SeqState(request, i, new_token_array(prompt_ids), gen,
                                  page_size=page_size) for i, gen in enumerate(gens)]
    if params.grammar is not None:
        for seq in request.sequences:
            seq.matcher = params.grammar.matcher()
    return request
