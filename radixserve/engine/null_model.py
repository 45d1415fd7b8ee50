"""A null model: the engine's step machinery with a stand-in for the forward pass, no torch.

`NullRunner.execute` takes the scheduler's `StepBatch`, checks its shape the way the real
runner relies on it, and returns token ids from a seeded `random.Random` (or one fixed id).
`OneCharTokenizer` decodes every token to one letter. `null_core` wires the real tree,
memory, scheduler and output processor around them: the scheduler tests and
`scripts/bench_scheduler.py` run thousands of steps a second this way.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from radixserve.cache.memory import PagedMemory
from radixserve.cache.radix_cache import RadixCache
from radixserve.engine.batch import SampleResult, StepBatch, StepResult
from radixserve.engine.core import EngineCore
from radixserve.engine.output_processor import OutputProcessor
from radixserve.engine.outputs import EngineStats
from radixserve.engine.scheduler import Scheduler, SchedulerConfig
from radixserve.engine.seq_memory import SequenceMemory

EOS_TOKEN = 2
FIRST_ORDINARY_TOKEN = 3     # the runner's random tokens start here: never an EOS


class OneCharDetokenizer:
    def push(self, token_id: int) -> str:
        return chr(97 + token_id % 26)


class OneCharTokenizer:
    """Token i decodes to letter i mod 26; token 2 is the end of sequence."""

    eos_token_ids = frozenset({EOS_TOKEN})

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> OneCharDetokenizer:
        return OneCharDetokenizer()


class NullRunner:
    """Stands in for ModelRunner.execute: no weights, no KV, no torch."""

    def __init__(self, page_size: int = 1, seed: int = 0, vocab_size: int = 1000,
                 token: int | None = None):
        self.page_size = page_size
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.token = token
        self.steps = 0

    def execute(self, batch: StepBatch) -> StepResult:
        check_batch(batch, self.page_size)
        self.steps += 1
        n = len(batch.sample_rows)
        if self.token is not None:
            tokens = [self.token] * n
        else:
            tokens = [self.rng.randrange(FIRST_ORDINARY_TOKEN, self.vocab_size) for _ in range(n)]
        return StepResult(SampleResult(tokens, [None] * n))


def check_batch(batch: StepBatch, page_size: int) -> None:
    """What the runner and attention assume of a batch; AssertionError when broken."""
    lens = [span.new_len for span in batch.spans]
    assert len(batch.input_ids) == len(batch.positions) == sum(lens), "token count mismatch"
    assert all(n >= 1 for n in lens), "an empty span"
    multi = [n > 1 for n in lens]
    assert multi == sorted(multi, reverse=True), "prefill spans must come first"
    assert len(batch.sample_rows) == len(batch.sample_params) == len(batch.generators)
    for span in batch.spans:
        assert span.pages.size * page_size >= span.cached_len + span.new_len, \
            "a span's pages do not cover its tokens"


def null_core(*, num_pages: int, page_size: int = 1, max_running: int = 256,
              token_budget: int = 2048, policy: str = "lpm", use_cache: bool = True,
              max_model_len: int = 1 << 20) -> EngineCore:
    """The engine's real scheduling stack over a pool of `num_pages` pages (no KV data)."""
    tree = RadixCache(page_size=page_size)
    memory = SequenceMemory(PagedMemory(num_pages, tree), use_cache=use_cache)
    stats = EngineStats(pages_total=num_pages, page_size=page_size)
    scheduler = Scheduler(SchedulerConfig(page_size=page_size, max_running=max_running,
                                          token_budget=token_budget, policy=policy),
                          memory, stats)
    return EngineCore(scheduler, OutputProcessor(OneCharTokenizer(), stats, max_model_len))
