"""A hybrid model (tiny Gemma 3, window 16) through the real engine and radix tree: prompts
reusing a cached prompt's first tokens at several points generate what they generate with
the cache off, and every page is accounted for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_helpers import check_pages, collect, make_engine, run_scenario
from radixserve.attention.fixed_split import FixedSplitBackend
from radixserve.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hybrid_models import WINDOW, build_family  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
DONOR = list(range(10, 10 + 8 * WINDOW))               # 128 tokens, 8 windows
HITS = [WINDOW // 2, WINDOW, 5 * WINDOW, 3 * WINDOW + 2]   # in W, at W, far, mid-page
PROMPTS = [DONOR] + [DONOR[:h] + list(range(200, 210)) for h in HITS]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_family("gemma3", tmp_path_factory.mktemp("engine-gemma3")).loaded


def run_in_order(engine):
    async def scenario(engine):
        return [await collect(engine.generate(p, GREEDY)) for p in PROMPTS]
    return run_scenario(engine, scenario, check=check_pages)


def test_cached_hits_equal_uncached(gemma3):
    expected = [r.token_ids[0] for r in run_in_order(
        make_engine(gemma3, page_size=4, disable_radix_cache=True))]
    got = run_in_order(make_engine(gemma3, page_size=4))
    assert [r.token_ids[0] for r in got] == expected
    cached = [r.final.usage.cached_tokens for r in got[1:]]
    for hit, c in zip(HITS, cached):
        assert hit // 4 * 4 <= c <= hit, (hit, cached)


def test_deterministic_greedy_identical_alone_and_batched(gemma3):
    """--deterministic with sliding windows (fp32): each prompt alone with the cache off
    gives the tokens it gives batched with the others, in reverse order, its prefill cut
    into chunks, on a page-size-4 cache it partly hits."""
    import asyncio

    def run(engine, together: bool):
        async def scenario(engine):
            if not together:
                return [await collect(engine.generate(p, GREEDY)) for p in PROMPTS]
            got = await asyncio.gather(*(collect(engine.generate(p, GREEDY))
                                         for p in PROMPTS[::-1]))
            return got[::-1]
        return run_scenario(engine, scenario, check=check_pages)

    alone = run(make_engine(gemma3, deterministic=True, disable_radix_cache=True), False)
    busy = make_engine(gemma3, deterministic=True, page_size=4, chunked_prefill_size=24)
    together = run(busy, True)
    assert [r.token_ids[0] for r in together] == [r.token_ids[0] for r in alone]
    assert isinstance(busy.runner.backend, FixedSplitBackend)     # with the model's windows
    assert WINDOW in busy.runner.backend.layer_windows
    assert sum(r.final.usage.cached_tokens for r in together) > 0
