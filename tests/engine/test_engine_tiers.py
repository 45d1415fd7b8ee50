"""Tiers in the engine: a prefix evicted from the pool to host memory (or disk) comes back
by loading, gives the same greedy tokens as the cache off (fp32) and counts as cached."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import (QUESTIONS, SYSTEM_PROMPT, chat_ids, collect, loads_unmeasured,
                            make_engine, wait_idle)
from prometheus_client import generate_latest

from radixserve.engine.sampling_params import SamplingParams
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import stats_body

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
OTHER_SYSTEM = ("You are a terse librarian who answers with the title of one book and its "
                "author, nothing else, and who never recommends films or music. ") * 3


def run_in_turn(engine, prompts, params=GREEDY):
    """Start, run the prompts one after another, check conservation after each, stop."""
    async def main():
        await engine.start()
        try:
            out = []
            for p in prompts:
                out.append(await collect(engine.generate(p, params)))
                await wait_idle(engine)
                engine.check_invariants()
            return out
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def scenario(engine):
    """A, then five others (other system prompts, filling the pool: A leaves it), then A."""
    a = chat_ids(engine, QUESTIONS[0])
    systems = [OTHER_SYSTEM, OTHER_SYSTEM.upper(), OTHER_SYSTEM.replace("book", "poem"),
               OTHER_SYSTEM.replace("librarian", "archivist"), OTHER_SYSTEM.lower()]
    others = [chat_ids(engine, QUESTIONS[i], system=system)
              for i, system in enumerate(systems, start=1)]
    return [a, *others, a]


def pool_for(prompts) -> int:
    # Room for two conversations: the later ones push A out. (Not much less: a tiny pool
    # can leave a copy-on-write lock holding more than a new prompt can spare.)
    return 2 * (max(len(p) for p in prompts) + GREEDY.max_tokens + 32)


@pytest.fixture(scope="module")
def uncached(model_fp32):
    engine = make_engine(model_fp32, disable_radix_cache=True)
    prompts = scenario(engine)
    return prompts, [r.token_ids[0] for r in run_in_turn(engine, prompts)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prefix_demoted_to_host_memory_is_loaded_back(model_fp32, uncached, page_size):
    prompts, expected = uncached
    pool = pool_for(prompts) // page_size * page_size + 2 * page_size + 16
    engine = loads_unmeasured(make_engine(model_fp32, page_size=page_size,
                                          kv_cache_tokens=pool, kv_host_tokens=8 * pool))
    results = run_in_turn(engine, prompts)
    assert [r.token_ids[0] for r in results] == expected
    stats = engine.stats()
    assert stats.tiers.l2.demoted_tokens > 0
    assert stats.tiers.l2.loaded_tokens > 0
    system = len(chat_ids(engine, "")) - 8      # the system prompt's tokens, roughly
    again = results[-1].final.usage.cached_tokens
    assert again >= system, (again, system)
    assert results[0].final.usage.cached_tokens == 0
    engine.check_invariants()
    # /cache/stats and /metrics split the hits by tier.
    body = stats_body(stats)["tiers"]
    assert body["hit_tokens"]["l2"] == stats.tiers.l2.loaded_tokens
    assert body["hit_tokens"]["l1"] + body["hit_tokens"]["l2"] == stats.prefix_hit_tokens
    text = generate_latest(ServerMetrics(engine.stats).registry).decode()
    assert f'radixserve_kv_tier_loaded_tokens_total{{tier="l2"}} ' \
           f'{float(stats.tiers.l2.loaded_tokens)}' in text


def test_recompute_when_loading_is_measured_slower(model_fp32, uncached):
    prompts, expected = uncached
    pool = pool_for(prompts) + 16
    engine = make_engine(model_fp32, kv_cache_tokens=pool, kv_host_tokens=8 * pool)
    engine.tiers.costs.observe_load(2, 1, 1000.0)        # loading "measured" very slow
    results = run_in_turn(engine, prompts)
    assert [r.token_ids[0] for r in results] == expected
    assert engine.stats().tiers.l2.loaded_tokens == 0
    assert engine.stats().tiers.l2.demoted_tokens > 0


def test_8bit_kv_scales_travel_with_the_pages(model_fp32):
    """fp8 pages demoted and loaded back decode as before: the same tokens as fp8 with no
    tiers (whose hits read the pool's own codes and scales)."""
    plain = make_engine(model_fp32, kv_cache_dtype="fp8_e4m3")
    prompts = scenario(plain)
    pool = pool_for(prompts)
    plain = make_engine(model_fp32, kv_cache_dtype="fp8_e4m3", kv_cache_tokens=pool)
    expected = [r.token_ids[0] for r in run_in_turn(plain, prompts)]
    engine = loads_unmeasured(make_engine(model_fp32, kv_cache_dtype="fp8_e4m3",
                                          kv_cache_tokens=pool, kv_host_tokens=8 * pool))
    results = run_in_turn(engine, prompts)
    assert engine.stats().tiers.l2.loaded_tokens > 0
    assert [r.token_ids[0] for r in results] == expected


@pytest.mark.parametrize("host", [False, True], ids=["disk", "host+disk"])
def test_a_prefix_demoted_to_disk_is_loaded_back(model_fp32, uncached, tmp_path, host):
    prompts, expected = uncached
    pool = pool_for(prompts)
    engine = loads_unmeasured(make_engine(model_fp32, kv_cache_tokens=pool,
                                          kv_disk_dir=str(tmp_path),
                                          kv_host_tokens=pool // 2 if host else None))
    results = run_in_turn(engine, prompts)
    assert [r.token_ids[0] for r in results] == expected
    tiers = engine.stats().tiers
    assert tiers.l3.demoted_tokens > 0 and tiers.l3.loaded_tokens > 0
    assert results[-1].final.usage.cached_tokens >= len(chat_ids(engine, "")) - 8
    assert tiers.corrupt_pages == 0


def test_a_flipped_byte_on_disk_is_recomputed(model_fp32, uncached, tmp_path):
    """Every page of A on disk gets one byte flipped before A comes back: its replies are
    still the cache-off ones, the bad pages are never served, and they are counted."""
    prompts, expected = uncached
    pool = pool_for(prompts)
    engine = loads_unmeasured(make_engine(model_fp32, kv_cache_tokens=pool,
                                          kv_disk_dir=str(tmp_path)))
    flipped = []

    def flip_all_disk_pages():
        for path in sorted((tmp_path / "pages").rglob("*")):
            if path.is_file() and path.stat().st_size > 4096:
                data = bytearray(path.read_bytes())
                data[-100] ^= 0x40
                path.write_bytes(bytes(data))
                flipped.append(path)

    async def main():
        await engine.start()
        try:
            out = []
            for i, p in enumerate(prompts):
                if i == len(prompts) - 1:
                    flip_all_disk_pages()
                out.append(await collect(engine.generate(p, GREEDY)))
                await wait_idle(engine)
                engine.check_invariants()
            return out
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    assert flipped
    assert [r.token_ids[0] for r in results] == expected
    stats = engine.stats().tiers
    assert stats.corrupt_pages == 1          # the first bad page ends the load
    assert stats.l3.loaded_tokens == 0
