"""Cached and uncached generation agree; the cache reports hits; pages are conserved."""

from __future__ import annotations

import pytest

from engine_helpers import QUESTIONS, chat_ids, make_engine, run_all
from radixserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def uncached_outputs(model_fp32):
    engine = make_engine(model_fp32, disable_radix_cache=True)
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    results = run_all(engine, prompts, GREEDY)
    assert all(r.final.usage.cached_tokens == 0 for r in results)
    return prompts, [r.token_ids[0] for r in results]


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_system_prompt_hits_and_matches_uncached(model_fp32, uncached_outputs, page_size):
    prompts, expected = uncached_outputs
    engine = make_engine(model_fp32, page_size=page_size)
    results = run_all(engine, prompts, GREEDY, stagger=0.05)
    assert [r.token_ids[0] for r in results] == expected
    cached = [r.final.usage.cached_tokens for r in results]
    system_len = len(chat_ids(engine, "", system=QUESTIONS[0])) // 2
    # Every request after the first computes the system prompt from the cache.
    assert sum(c > system_len for c in cached) >= len(prompts) - 1, cached
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= sum(cached)
    assert stats.requests_finished.get("length", 0) + stats.requests_finished.get("stop", 0) == 16


@pytest.mark.parametrize("page_size", [1, 16])
def test_small_pool_forces_eviction_and_preemption(model_fp32, uncached_outputs, page_size):
    prompts, expected = uncached_outputs
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    # Room for about two sequences: admission must wait, decodes must preempt.
    engine = make_engine(model_fp32, page_size=page_size,
                         kv_cache_tokens=2 * longest + 64, chunked_prefill_size=256)
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0)
    results = run_all(engine, prompts, params)
    assert [r.token_ids[0] for r in results] == expected
    assert all(r.final.finish_reason in ("length", "stop") for r in results)
    assert engine.stats().evicted_tokens > 0


def test_preemption_recompute_hits(model_fp32, uncached_outputs):
    prompts, expected = uncached_outputs
    longest = max(len(p) for p in prompts) + 40
    engine = make_engine(model_fp32, kv_cache_tokens=longest + longest // 2,
                         chunked_prefill_size=1024, schedule_policy="fcfs")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = run_all(engine, prompts[:4], params)
    assert all(len(r.token_ids[0]) == 40 for r in results)
    stats = engine.stats()
    assert stats.preemptions > 0
    # Re-admission after preemption matched what the victim had inserted.
    assert stats.recompute_hit_tokens > 0
