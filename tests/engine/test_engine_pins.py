"""Pinned prefixes on the real engine: a pin survives a flood that evicts everything else,
unpinning makes it evictable again, the token budget is enforced, pins are idempotent and
namespaced, and every scenario ends with page conservation (pins' locks accounted for)."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine_helpers import QUESTIONS, chat_ids, collect, make_engine, run_scenario, wait_idle
from engine_helpers import check_pages as check_conserved
from radixserve.engine.errors import InvalidRequest, PinConflict, PinLimitExceeded, UnknownPin
from radixserve.engine.sampling_params import SamplingParams

POOL = 1024
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def small_engine(model, **overrides):
    """A pool of 1024 tokens, a context of 384: flooding it takes a few short requests."""
    return make_engine(model, **{"kv_cache_tokens": POOL, "max_model_len": 384,
                                 "chunked_prefill_size": 256, **overrides})


def flood_prompts(n: int, length: int = 300, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


def run(engine, scenario):
    """Run `scenario(engine)` on a started engine; conservation checked at the end, and
    shutting down releases every pin."""
    result = run_scenario(engine, scenario, check=check_pages)
    assert engine.tree.locked_tokens == 0
    return result


def check_pages(engine) -> None:
    """Conservation, and every lock held while idle is a pin's."""
    check_conserved(engine)
    assert engine.tree.locked_tokens == engine.pins.locked_tokens()


async def ask(engine, prompt, namespace=None):
    return (await collect(engine.generate(prompt, ONE, namespace))).final


async def flood(engine, n: int = 8, namespace=None, seed: int = 0) -> None:
    for prompt in flood_prompts(n, seed=seed):
        await ask(engine, prompt, namespace)


def pinned_prefix_cached(engine, tokens, namespace=None) -> int:
    return engine.tree.peek_prefix(tokens, namespace)


@pytest.mark.parametrize("page_size", [1, 4])
def test_pin_survives_a_flood_and_unpin_lets_it_go(model_fp32, page_size):
    engine = small_engine(model_fp32, page_size=page_size)

    async def scenario(engine):
        system = chat_ids(engine, "")[:-8]          # the system block, a pinnable prefix
        info = await engine.pin(system)
        size = len(system) - len(system) % page_size
        assert (info.tokens, info.cached_tokens, info.created) == (size, 0, True)
        assert engine.stats().pinned_tokens == size
        check_pages(engine)

        await flood(engine)                         # 8 x 300 tokens through a 1024 pool
        assert engine.stats().evicted_tokens > POOL        # every unpinned page turned over
        assert pinned_prefix_cached(engine, system) >= size
        final = await ask(engine, chat_ids(engine, QUESTIONS[0]))
        assert final.usage.cached_tokens >= size    # the request hit the whole pin
        check_pages(engine)

        assert await engine.unpin(info.pin_id) == info
        assert engine.tree.locked_tokens == 0 and engine.stats().pinned_tokens == 0
        check_pages(engine)
        await flood(engine, seed=1)
        assert pinned_prefix_cached(engine, system) < size      # evictable again, evicted
        with pytest.raises(UnknownPin):
            await engine.unpin(info.pin_id)

    run(engine, scenario)


def test_pinning_a_cached_prefix_runs_nothing_and_twice_keeps_one_pin(model_fp32):
    engine = small_engine(model_fp32)

    async def scenario(engine):
        prompt = chat_ids(engine, QUESTIONS[1])
        await ask(engine, prompt)                   # now cached, whole prompt
        before = engine.stats().prompt_tokens
        info = await engine.pin(prompt)
        assert (info.tokens, info.cached_tokens) == (len(prompt), len(prompt))
        assert engine.stats().prompt_tokens == before           # no request was run
        again = await engine.pin(prompt)
        assert (again.pin_id, again.created, again.tokens) == (info.pin_id, False, info.tokens)
        assert engine.stats().pinned_tokens == len(prompt)      # counted once
        assert [p.pin_id for p in engine.pinned()] == [info.pin_id]
        locked = engine.tree.locked_tokens
        assert locked == len(prompt)
        await engine.unpin(info.pin_id)                   # one unpin undoes it
        assert engine.tree.locked_tokens == 0 and engine.pinned() == []

    run(engine, scenario)


def test_the_same_prefix_pinned_twice_at_once_is_computed_and_counted_once(model_fp32):
    engine = small_engine(model_fp32, max_pinned_tokens=200)

    async def scenario(engine):
        prompt = flood_prompts(1, 150, seed=11)[0]     # twice would pass the budget
        before = engine.stats().prompt_tokens
        a, b = await asyncio.gather(engine.pin(prompt), engine.pin(prompt))
        assert a.pin_id == b.pin_id and {a.created, b.created} == {True, False}
        assert engine.stats().pinned_tokens == 150
        assert engine.stats().prompt_tokens - before == 150     # one request computed it
        assert engine.tree.locked_tokens == 150
        # One of two waiters going away keeps the pin coming for the other.
        other = flood_prompts(1, 40, seed=12)[0]
        first = asyncio.create_task(engine.pin(other))
        await asyncio.sleep(0)
        second = asyncio.create_task(engine.pin(other))
        await asyncio.sleep(0)
        first.cancel()
        info = await second
        assert info.tokens == 40 and engine.stats().pinned_tokens == 190
        with pytest.raises(asyncio.CancelledError):
            await first

    run(engine, scenario)


def test_budget_409_numbers_and_bad_prompts(model_fp32):
    engine = small_engine(model_fp32, max_pinned_tokens=200)

    async def scenario(engine):
        rng = random.Random(5)
        first = [rng.randrange(1000, 40000) for _ in range(150)]
        second = [rng.randrange(1000, 40000) for _ in range(80)]
        await engine.pin(first)
        with pytest.raises(PinLimitExceeded) as err:
            await engine.pin(second)
        assert (err.value.requested, err.value.pinned, err.value.limit) == (80, 150, 200)
        assert "80" in str(err.value) and "150" in str(err.value) and "200" in str(err.value)
        assert engine.stats().pinned_tokens == 150          # the refused pin left nothing
        await engine.pin(second[:50])                       # exactly at the limit
        assert engine.stats().pinned_tokens == 200
        await engine.unpin(engine.pinned()[0].pin_id)
        with pytest.raises(PinLimitExceeded, match="alone is longer") as err:
            await engine.pin([7] * 201)
        assert (err.value.requested, err.value.pinned, err.value.limit) == (201, 50, 200)
        with pytest.raises(InvalidRequest):                 # longer than the context
            await engine.pin([5] * 400)
        with pytest.raises(InvalidRequest):                 # not a token id
            await engine.pin([10 ** 9])
        with pytest.raises(InvalidRequest):
            await engine.pin([])
        check_pages(engine)

    run(engine, scenario)


def test_limit_is_lowered_to_leave_room_for_a_full_context(model_fp32):
    assert small_engine(model_fp32).pins.limit == POOL // 4                 # the default
    assert small_engine(model_fp32, max_pinned_tokens=10 ** 6).pins.limit \
        == POOL - 384 - 16 - 1
    engine = small_engine(model_fp32, max_pinned_tokens=0)

    async def scenario(engine):
        with pytest.raises(PinLimitExceeded, match="pinning is off"):
            await engine.pin(list(range(1000, 1010)))

    run(engine, scenario)
    engine = small_engine(model_fp32, disable_radix_cache=True)

    async def no_cache(engine):
        with pytest.raises(PinConflict, match="disable-radix-cache"):
            await engine.pin(list(range(1000, 1010)))

    run(engine, no_cache)


def test_a_full_context_request_still_runs_beside_pins_at_the_limit(model_fp32):
    """The lowered limit leaves room for one request of the whole context: pinned pages
    never come back, so without it such a request would wait forever."""
    engine = small_engine(model_fp32, max_pinned_tokens=10 ** 6)
    limit = engine.pins.limit

    async def scenario(engine):
        first, second = flood_prompts(2, length=limit - limit // 2, seed=4)
        await engine.pin(first[:limit // 2])
        await engine.pin(second)
        assert engine.stats().pinned_tokens == limit
        prompt = flood_prompts(1, length=370, seed=5)[0]
        params = SamplingParams(max_tokens=384 - 370, temperature=0.0, ignore_eos=True)
        final = (await collect(engine.generate(prompt, params))).final
        assert (final.finish_reason, final.usage.completion_tokens) == ("length", 14)

    run(engine, scenario)


def test_namespaces_isolate_pins(model_fp32):
    engine = small_engine(model_fp32, max_pinned_tokens=400)

    async def scenario(engine):
        system = chat_ids(engine, "")[:-8]
        info = await engine.pin(system, namespace="tenant-a")
        assert info.namespace == "tenant-a"
        other = await engine.pin(system)            # the same tokens elsewhere: its own pin
        assert other.pin_id != info.pin_id and other.cached_tokens == 0
        await engine.unpin(other.pin_id)
        await flood(engine)
        await flood(engine, namespace="tenant-a", seed=2)
        prompt = chat_ids(engine, QUESTIONS[2])
        assert (await ask(engine, prompt, "tenant-a")).usage.cached_tokens >= len(system)
        assert (await ask(engine, prompt, "tenant-b")).usage.cached_tokens == 0
        check_pages(engine)

    run(engine, scenario)


def test_pin_under_concurrent_pressure_and_cancelled_pin(model_fp32):
    """A pin computed while other requests fill the pool is locked before the next step
    (nothing evicts it in between); a pin cancelled while computing takes no lock."""
    engine = small_engine(model_fp32, page_size=4)

    async def scenario(engine):
        system = chat_ids(engine, "")[:-8]
        floods = [asyncio.create_task(flood(engine, 3, seed=s)) for s in range(3)]
        info = await engine.pin(system)
        await asyncio.gather(*floods)
        await flood(engine, seed=9)
        assert engine.stats().evicted_tokens > POOL
        assert pinned_prefix_cached(engine, system) >= info.tokens
        await engine.unpin(info.pin_id)

        task = asyncio.create_task(engine.pin(flood_prompts(1, 200, seed=7)[0]))
        await asyncio.sleep(0)                      # queued, not computed yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        assert engine.pinned() == [] and engine.tree.locked_tokens == 0
        check_pages(engine)

    run(engine, scenario)


def test_flush_keeps_pins_and_namespace_flush_refuses(model_fp32):
    engine = small_engine(model_fp32)

    async def scenario(engine):
        from radixserve.engine.errors import CacheBusy
        system = chat_ids(engine, "")[:-8]
        info = await engine.pin(system, namespace="t")
        await ask(engine, flood_prompts(1)[0])
        await engine.flush_cache()
        assert engine.tree.total_tokens == info.tokens      # only the pin is left
        with pytest.raises(CacheBusy, match="pinned"):
            await engine.flush_namespace("t")
        await engine.unpin(info.pin_id)
        assert await engine.flush_namespace("t") == info.tokens
        check_pages(engine)

    run(engine, scenario)
