"""A DeepSeek-V3 MoE model (tiny, MLA) through the real engine and radix tree: latent pages
shared at several hit points (inside a page, at page boundaries) generate what the cache
off generates, every page is accounted for, and latent pages demoted to host memory come back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_helpers import check_pages, collect, make_engine, run_scenario
from radixserve.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from mla_models import build_mla_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
DONOR = list(range(10, 74))                                  # 64 tokens
HITS = [6, 8, 33, 36]                # inside a page, at one, inside a later one, at one
PROMPTS = [DONOR] + [DONOR[:h] + list(range(200, 210)) for h in HITS]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return build_mla_model("v3-moe", tmp_path_factory.mktemp("engine-mla")).loaded


def run_in_order(engine):
    async def scenario(engine):
        return [await collect(engine.generate(p, GREEDY)) for p in PROMPTS]
    return run_scenario(engine, scenario, check=check_pages)


def test_cached_hits_equal_uncached(deepseek):
    expected = [r.token_ids[0] for r in run_in_order(
        make_engine(deepseek, page_size=4, disable_radix_cache=True))]
    engine = make_engine(deepseek, page_size=4)
    assert type(engine.runner.kv_pool).__name__ == "LatentKVPool"
    got = run_in_order(engine)
    assert [r.token_ids[0] for r in got] == expected
    cached = [r.final.usage.cached_tokens for r in got[1:]]
    for hit, c in zip(HITS, cached):
        assert hit // 4 * 4 <= c <= hit, (hit, cached)
    assert "MLA latents" in engine.describe_kv_cache()


def test_int8_latents_cached_equal_uncached(deepseek):
    """8-bit latents (one scale per token and layer): the cache on generates what the cache
    off generates with the same format, pages conserved."""
    expected = [r.token_ids[0] for r in run_in_order(
        make_engine(deepseek, page_size=4, kv_cache_dtype="int8", disable_radix_cache=True))]
    engine = make_engine(deepseek, page_size=4, kv_cache_dtype="int8")
    assert engine.runner.kv_pool.quantized
    assert [r.token_ids[0] for r in run_in_order(engine)] == expected


def test_latent_prefix_demoted_to_host_is_loaded_back(deepseek):
    """A, four others filling a small pool (A's latent pages go to host memory), then A
    again: loaded back, the same greedy tokens as the cache off, counted as cached."""
    a = list(range(10, 90))
    others = [list(range(100 + 7 * i, 180 + 7 * i)) for i in range(4)]
    prompts = [a, *others, a]

    def in_turn(engine):
        async def scenario(engine):
            return [await collect(engine.generate(p, GREEDY)) for p in prompts]
        return run_scenario(engine, scenario, check=check_pages)

    expected = [r.token_ids[0] for r in in_turn(
        make_engine(deepseek, page_size=4, disable_radix_cache=True))]
    pool = 2 * (80 + 8 + 32)
    engine = make_engine(deepseek, page_size=4, kv_cache_tokens=pool,
                         kv_host_tokens=8 * pool)
    results = in_turn(engine)
    assert [r.token_ids[0] for r in results] == expected
    stats = engine.stats()
    assert stats.tiers.l2.demoted_tokens > 0 and stats.tiers.l2.loaded_tokens > 0
    assert results[-1].final.usage.cached_tokens >= 76


def test_latent_pages_persist_across_a_restart_and_a_pin_holds_them(deepseek, tmp_path):
    """--kv-disk-dir saves latent pages at shutdown and the next engine loads them back (the
    same greedy tokens as the cache off, counted as cached, no corrupt page); a pinned
    latent prefix survives a flood that fills the pool and is hit whole."""
    a = list(range(10, 90))
    follow = a + list(range(240, 246))
    others = [list(range(100 + 7 * i, 180 + 7 * i)) for i in range(4)]

    def in_turn(engine, prompts, pin=None):
        async def scenario(engine):
            if pin is not None:
                await engine.pin(pin)
            return [await collect(engine.generate(p, GREEDY)) for p in prompts]
        return run_scenario(engine, scenario, check=check_pages)

    off = make_engine(deepseek, page_size=4, disable_radix_cache=True)
    expected = [r.token_ids[0] for r in in_turn(off, [a, follow, *others, follow])]
    kv = str(tmp_path / "kv")
    first = make_engine(deepseek, page_size=4, kv_disk_dir=kv)
    assert in_turn(first, [a])[0].token_ids[0] == expected[0]
    assert first.persistence.last_save.pages_written > 0
    second = make_engine(deepseek, page_size=4, kv_disk_dir=kv)
    [again] = in_turn(second, [follow])
    assert again.token_ids[0] == expected[1]
    assert again.final.usage.cached_tokens == len(a)
    assert second.stats().kv_disk.corrupt_pages == 0

    pool = 2 * (80 + 8 + 32)
    pinned = make_engine(deepseek, page_size=4, kv_cache_tokens=pool + 80,
                         max_pinned_tokens=80, max_model_len=128)
    results = in_turn(pinned, [*others, follow], pin=a)
    assert [r.token_ids[0] for r in results] == expected[2:]
    assert results[-1].final.usage.cached_tokens == len(a)
