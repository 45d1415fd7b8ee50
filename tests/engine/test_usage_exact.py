"""`usage.cached_tokens` is exactly the prompt tokens the engine did not compute: each
step's computed tokens are counted at the runner, and for every request (run one at a
time) prompt - cached == what its steps computed for the prompt. Hits from the pool, from
host memory and from disk count; a first request counts 0; a preempted request's recompute
hits do not count (they are reported apart, as recompute_hit_tokens)."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import collect, make_engine, wait_idle
from radixserve.engine.sampling_params import SamplingParams
from test_engine_tiers import pool_for, scenario

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def count_computed(engine) -> list[int]:
    """Tokens each step computes, appended as the runner runs."""
    computed: list[int] = []
    execute = engine.runner.execute

    def counting(batch):
        computed.append(batch.num_tokens)
        return execute(batch)

    engine.runner.execute = counting
    return computed


def run_counted(engine, prompts) -> list[tuple[int, int, int]]:
    """(prompt tokens, cached tokens, prompt tokens computed) per request, one at a time."""
    computed = count_computed(engine)

    async def main():
        await engine.start()
        try:
            out = []
            for p in prompts:
                before = len(computed)
                result = await collect(engine.generate(p, GREEDY))
                await wait_idle(engine)
                engine.check_invariants()
                usage = result.final.usage
                spent = sum(computed[before:]) - (usage.completion_tokens - 1)   # decodes
                out.append((usage.prompt_tokens, usage.cached_tokens, spent))
            return out
        finally:
            await engine.shutdown()
    return asyncio.run(main())


@pytest.mark.parametrize("tier", ["pool", "host", "disk"])
def test_cached_tokens_are_the_tokens_not_computed(model_fp32, tier, tmp_path):
    probe = make_engine(model_fp32)
    prompts = scenario(probe)
    pool = pool_for(prompts) + 16
    extra = {"pool": {"kv_cache_tokens": 16 * pool},
             "host": {"kv_cache_tokens": pool, "kv_host_tokens": 8 * pool},
             "disk": {"kv_cache_tokens": pool, "kv_disk_dir": str(tmp_path)}}[tier]
    engine = make_engine(model_fp32, **extra)
    rows = run_counted(engine, prompts)
    for prompt, cached, spent in rows:
        assert prompt - cached == spent, rows
    assert rows[0][1] == 0                      # nothing cached yet: 0, not omitted
    assert rows[-1][1] > 50                     # the first prompt again: a hit...
    if tier != "pool":                          # ...loaded back from below the pool
        name = {"host": "l2", "disk": "l3"}[tier]
        assert getattr(engine.stats().tiers, name).loaded_tokens > 0


def test_preemption_recompute_is_not_counted_as_cached(model_fp32):
    """Two cold prompts whose decodes cannot both fit: one is preempted, re-admitted with
    a hit on its own inserted pages; its usage still says 0 cached."""
    engine = make_engine(model_fp32, kv_cache_tokens=160, max_model_len=120)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = [[1000 + i for i in range(40)], [3000 + i for i in range(40)]]

    async def main():
        await engine.start()
        try:
            results = await asyncio.gather(*(collect(engine.generate(p, params))
                                             for p in prompts))
            await wait_idle(engine)
            engine.check_invariants()
            return results
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.recompute_hit_tokens > 0
    assert [r.final.usage.cached_tokens for r in results] == [0, 0]
