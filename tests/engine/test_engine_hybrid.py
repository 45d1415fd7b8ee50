"""A hybrid model (tiny Gemma 3, window 16) through the real engine and the window-aware
radix tree (per-group pools): prompts reusing a cached prompt's first tokens at several
points generate what they generate with the cache off, every match ends where the rule
says (docs/models.md, "Window-aware cache"), and every page of both pools is accounted for."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

from engine_helpers import check_pages, collect, make_engine, run_scenario
from radixserve.attention.fixed_split import FixedSplitBackend
from radixserve.cache.miss_reasons import MissReason
from radixserve.cache.window_memory import WindowedMemory
from radixserve.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hybrid_models import WINDOW, build_family  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
DONOR = list(range(10, 10 + 8 * WINDOW))               # 128 tokens, 8 windows
HITS = [WINDOW // 2, WINDOW, 5 * WINDOW, 3 * WINDOW + 2]   # in W, at W, far, mid-page
CHECKPOINT = 2 * WINDOW
# Round 1 diverges from the donor at each hit; round 2 diverges at the same points again,
# now branch points whose windows round 1 left in the tree.
PROMPTS = ([DONOR] + [DONOR[:h] + list(range(200, 210)) for h in HITS]
           + [DONOR[:h] + list(range(230, 240)) for h in HITS])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_family("gemma3", tmp_path_factory.mktemp("engine-gemma3")).loaded


def run_in_order(engine):
    async def scenario(engine):
        return [await collect(engine.generate(p, GREEDY)) for p in PROMPTS]
    return run_scenario(engine, scenario, check=check_pages)


def first_round_hit(hit: int) -> int:
    """Round 1: the first window's points, else the last checkpoint (the donor's path has
    no other match point before its end)."""
    return hit if hit <= WINDOW else max(WINDOW, hit // CHECKPOINT * CHECKPOINT)


def test_cached_hits_equal_uncached(gemma3):
    expected = [r.token_ids[0] for r in run_in_order(
        make_engine(gemma3, page_size=4, disable_radix_cache=True))]
    engine = make_engine(gemma3, page_size=4, kv_window_checkpoint=CHECKPOINT)
    assert isinstance(engine.memory, WindowedMemory)
    # Per-group pools: the windowed pool is a fraction of the full-attention one.
    assert 0 < engine.runner.window_pages < engine.runner.num_pages
    got = run_in_order(engine)
    assert [r.token_ids[0] for r in got] == expected
    cached = [r.final.usage.cached_tokens for r in got[1:]]
    assert cached[:len(HITS)] == [first_round_hit(h) for h in HITS]
    # A match that backed off for a missing window says so (cache/miss_reasons.py).
    reasons = [r.final.usage.miss.reason for r in got[1:len(HITS) + 1]]
    assert [r == MissReason.WINDOW_MISSING for r in reasons] == [
        first_round_hit(h) < h for h in HITS], reasons
    for hit, c in zip(HITS, cached[len(HITS):]):
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

    # Alone on one full-KV pool; batched on the per-group pools (the windowed layers' own
    # fixed-split plan reads the null page before each window, masked like any other).
    alone = run(make_engine(gemma3, deterministic=True, disable_radix_cache=True,
                            kv_window_pool="off"), False)
    busy = make_engine(gemma3, deterministic=True, page_size=4, chunked_prefill_size=24)
    together = run(busy, True)
    assert [r.token_ids[0] for r in together] == [r.token_ids[0] for r in alone]
    assert isinstance(busy.memory, WindowedMemory)
    win_backend = busy.runner.windowed.backend
    assert isinstance(win_backend, FixedSplitBackend)     # with the model's window
    assert WINDOW in win_backend.layer_windows
    assert sum(r.final.usage.cached_tokens for r in together) > 0


def test_quantized_kv_cached_equals_uncached_with_window_pools(gemma3):
    """int8 KV in both pools (codes and scales per page in each): the hits at every point
    generate what the cache-off run with the same format generates."""
    expected = [r.token_ids[0] for r in run_in_order(
        make_engine(gemma3, page_size=4, disable_radix_cache=True, kv_cache_dtype="int8"))]
    engine = make_engine(gemma3, page_size=4, kv_window_checkpoint=CHECKPOINT,
                         kv_cache_dtype="int8")
    assert engine.runner.windowed.pool.kv_format == engine.runner.kv_pool.kv_format
    assert engine.runner.kv_pool.kv_format.k == "int8"
    got = run_in_order(engine)
    assert [r.token_ids[0] for r in got] == expected
    assert [r.final.usage.cached_tokens for r in got[1:len(HITS) + 1]] == [
        first_round_hit(h) for h in HITS]


def test_two_window_sizes_share_one_windowed_pool_at_the_larger(gemma3):
    """Layers of windows 16 and 8 (written by hand: no served family has two): one
    windowed pool kept at 16 for both, each layer attending within its own window. Greedy
    tokens equal the one-full-pool run's (every token's KV in every layer, the reference
    path for per-layer windows) with the cache on and off; the hits are the rule's at 16;
    both pools conserved."""
    two = dataclasses.replace(gemma3, config=dataclasses.replace(
        gemma3.config, layer_windows=(WINDOW, None, WINDOW // 2)))
    expected = [r.token_ids[0] for r in run_in_order(
        make_engine(two, page_size=4, kv_window_pool="off", disable_radix_cache=True))]
    engine = make_engine(two, page_size=4, kv_window_checkpoint=CHECKPOINT)
    assert isinstance(engine.memory, WindowedMemory) and engine.memory.rule.window == WINDOW
    assert engine.runner.windowed.backend.layer_windows[2] == WINDOW // 2
    got = run_in_order(engine)
    assert [r.token_ids[0] for r in got] == expected
    assert [r.final.usage.cached_tokens for r in got[1:len(HITS) + 1]] == [
        first_round_hit(h) for h in HITS]
    uncached = run_in_order(make_engine(two, page_size=4, disable_radix_cache=True))
    assert [r.token_ids[0] for r in uncached] == expected


def test_full_kv_pool_when_off(gemma3):
    engine = make_engine(gemma3, page_size=4, kv_window_pool="off")
    assert engine.runner.windowed is None and not isinstance(engine.memory, WindowedMemory)


def test_a_pin_and_a_partial_page_hit_with_window_pools(gemma3):
    """A pinned prefix is hit whole by the next request; a hit ending inside a page (within
    the first window, a kept match point) copies the full and the windowed part of the page
    (copy-on-write) and generates as uncached."""
    pinned, mid_page = DONOR[:6 * WINDOW], DONOR[:WINDOW - 6]     # 10: inside a page

    async def scenario(engine):
        info = await engine.pin(pinned)
        # The pin also keeps its end window [80, 96) from being dropped for room.
        assert engine.memory.pinned_windows == WINDOW // 4
        outs = [await collect(engine.generate(pinned + [201, 202], GREEDY)),
                await collect(engine.generate(mid_page + [203], GREEDY))]
        check_pages(engine)
        assert (await engine.unpin(info.pin_id)).tokens == len(pinned)
        assert engine.memory.pinned_windows == 0
        return outs

    uncached = run_scenario(make_engine(gemma3, page_size=4, disable_radix_cache=True),
                            lambda e: asyncio.gather(
                                collect(e.generate(pinned + [201, 202], GREEDY)),
                                collect(e.generate(mid_page + [203], GREEDY))))
    got = run_scenario(make_engine(gemma3, page_size=4), scenario)
    assert [g.token_ids[0] for g in got] == [u.token_ids[0] for u in uncached]
    assert got[0].final.usage.cached_tokens == len(pinned)
    assert got[1].final.usage.cached_tokens == len(mid_page)     # inside page 2: a copy


def test_abort_mid_prefill_mid_decode_and_a_disconnect_conserve_both_pools(gemma3):
    """Each request leaves at a different moment; after each, both pools are whole again:
    free + tree + live == total for the full pages and for the windowed pages."""
    engine = make_engine(gemma3, page_size=4, chunked_prefill_size=16)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def scenario(engine):
        stream = engine.generate(DONOR, long, request_id="prefill")
        task = asyncio.create_task(collect(stream))
        while engine.scheduler.stats.steps < 3:
            await asyncio.sleep(0.001)
        assert 0 < engine.scheduler.running[0].num_computed < len(DONOR)
        engine.abort("prefill")
        assert (await task).final.finish_reason == "abort"
        check_pages(engine)
        stream = engine.generate(PROMPTS[1], long, request_id="decode")
        async for out in stream:        # aborted after a few tokens, past the window
            if len(out.token_ids) and engine.scheduler.running and \
                    engine.scheduler.running[0].num_computed > len(PROMPTS[1]) + WINDOW:
                engine.abort("decode")
            if out.finished:
                assert out.finish_reason == "abort"
                break
        check_pages(engine)
        gone = engine.generate(PROMPTS[2], long, request_id="gone")
        async for out in gone:           # the client goes away
            if out.token_ids:
                break
        await gone.aclose()

    run_scenario(engine, scenario)
    assert engine.stats().requests_finished.get("abort") == 3


def test_preemption_conserves_both_pools_and_equals_uncached(gemma3):
    """Four short prompts with long decodes on a pool for about one and a half of them: they
    are admitted together, their decodes outgrow the pool and preempt; the tokens equal the
    cache-off run and both pools are conserved."""
    prompts = [[(t * k + k) % 251 + 5 for t in DONOR[:3 * WINDOW]] for k in (1, 3, 5, 7)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    def run(engine):
        return run_scenario(engine, lambda e: asyncio.gather(
            *(collect(e.generate(p, params)) for p in prompts)))

    expected = [r.token_ids[0] for r in run(
        make_engine(gemma3, page_size=4, disable_radix_cache=True))]
    engine = make_engine(gemma3, page_size=4, kv_cache_tokens=256, schedule_policy="fcfs")
    assert isinstance(engine.memory, WindowedMemory)
    assert [r.token_ids[0] for r in run(engine)] == expected
    assert engine.stats().preemptions > 0
