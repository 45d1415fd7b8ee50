"""Abort at every stage, step errors, parallel samples, stop strings and seeds."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import (QUESTIONS, chat_ids, collect, make_engine, run_all,
                            run_scenario, wait_idle)
from radixserve.engine.errors import InvalidRequest
from radixserve.engine.sampling_params import SamplingParams


def run(engine, scenario):
    """Run `scenario(engine)` on a started engine; always end with the conservation check."""
    return run_scenario(engine, scenario)


def failing_on_call(real, n: int, error: Exception, after: bool = False):
    """`real`, except that its n-th call raises `error` (after doing its work if `after`)."""
    calls = {"n": 0}

    def wrapper(*args):
        calls["n"] += 1
        if calls["n"] != n:
            return real(*args)
        if after:
            real(*args)
        raise error

    return wrapper


def test_abort_while_waiting(model_fp32):
    engine = make_engine(model_fp32, max_running_requests=1)

    async def scenario(engine):
        long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        first = asyncio.create_task(collect(engine.generate(chat_ids(engine, QUESTIONS[0]), long)))
        stream = engine.generate(chat_ids(engine, QUESTIONS[1]), long, request_id="waiter")
        await asyncio.sleep(0.05)
        assert any(s.request.request_id == "waiter" for s in engine.scheduler.waiting)
        engine.abort("waiter")
        waiter = await collect(stream)
        done = await first
        return waiter, done

    waiter, done = run(engine, scenario)
    assert waiter.final.finish_reason == "abort" and waiter.token_ids.get(0, []) == []
    assert len(done.token_ids[0]) == 30


def test_abort_mid_prefill(model_fp32):
    # A 16-token budget makes the prompt take several steps; abort after the first.
    engine = make_engine(model_fp32, chunked_prefill_size=16)

    async def scenario(engine):
        prompt = chat_ids(engine, QUESTIONS[2])
        stream = engine.generate(prompt, SamplingParams(max_tokens=5), request_id="p")
        task = asyncio.create_task(collect(stream))
        while engine.scheduler.stats.steps < 2:
            await asyncio.sleep(0.001)
        seq = engine.scheduler.running[0]
        assert 0 < seq.num_computed < len(prompt)
        engine.abort("p")
        return await task

    got = run(engine, scenario)
    assert got.final.finish_reason == "abort" and got.token_ids.get(0, []) == []
    # What was computed before the abort stays cached for the next request.
    assert engine.tree.total_tokens >= 16


def test_abort_mid_decode_and_consumer_going_away(model_fp32):
    engine = make_engine(model_fp32)

    async def scenario(engine):
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = engine.generate(chat_ids(engine, QUESTIONS[3]), params, request_id="d")
        tokens = 0
        async for out in stream:
            tokens += len(out.token_ids)
            if tokens >= 3:
                engine.abort("d")
            if out.finished:
                assert out.finish_reason == "abort"
                break
        # A consumer that simply stops iterating (client disconnect) aborts too.
        gone = engine.generate(chat_ids(engine, QUESTIONS[4]), params, request_id="g")
        async for out in gone:
            if out.token_ids:
                break
        await gone.aclose()
        return tokens

    tokens = run(engine, scenario)
    assert 3 <= tokens < 200
    assert engine.stats().requests_finished.get("abort") == 2


def one_after_another(*questions):
    """A scenario: 8 greedy tokens for each question, each request after the previous one."""

    async def scenario(engine):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        return [await collect(engine.generate(chat_ids(engine, q), params)) for q in questions]

    return scenario


def test_forward_error_fails_step_and_engine_keeps_serving(model_fp32, monkeypatch):
    engine = make_engine(model_fp32)
    monkeypatch.setattr(engine.runner, "execute",
                        failing_on_call(engine.runner.execute, 3, RuntimeError("injected failure")))

    first, second = run(engine, one_after_another(QUESTIONS[5], QUESTIONS[6]))
    assert first.final.finish_reason == "error" and "injected failure" in first.final.error
    assert second.final.finish_reason == "length" and len(second.token_ids[0]) == 8


def test_parallel_samples_share_the_prompt(model_fp32):
    engine = make_engine(model_fp32)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=3)
    prompt = chat_ids(engine, QUESTIONS[7])
    (got,) = run_all(engine, [prompt], params)
    assert sorted(got.finals) == [0, 1, 2]
    # Sample 0 computed the prompt; the others read its pages through the tree.
    assert got.finals[0].usage.cached_tokens == 0
    assert all(got.finals[i].usage.cached_tokens == len(prompt) - 1 for i in (1, 2))
    assert len({tuple(got.token_ids[i]) for i in range(3)}) > 1


def test_seed_reproduces_and_differs(model_fp32):
    def sample(seed):
        engine = make_engine(model_fp32)
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return run_all(engine, [chat_ids(engine, QUESTIONS[8])], params)[0].token_ids[0]

    assert sample(123) == sample(123)
    assert sample(123) != sample(124)


def test_stop_string_spanning_tokens(model_fp32):
    engine = make_engine(model_fp32)
    prompt = chat_ids(engine, "Count from one to twenty in words, separated by commas.")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    (free,) = run_all(make_engine(model_fp32), [prompt], greedy)
    text = free.text[0]
    tok = engine.tokenizer
    # Pick a stop string that straddles a token boundary of the greedy output.
    pieces = [tok.decode([t]) for t in free.token_ids[0]]
    boundary = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = text[boundary - 2: boundary + 2]
    assert len(stop) == 4 and stop in text
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
    (got,) = run_all(engine, [prompt], params)
    assert got.final.finish_reason == "stop" and got.final.stop_reason == stop
    assert got.text[0] == text[: text.index(stop)]


def test_invalid_params_allocate_nothing(model_fp32):
    engine = make_engine(model_fp32)

    async def scenario(engine):
        free_before = engine.memory.num_free
        for bad in [SamplingParams(max_tokens=0), SamplingParams(temperature=-1),
                    SamplingParams(top_p=0), SamplingParams(n=0)]:
            with pytest.raises(InvalidRequest):
                engine.generate([1, 2, 3], bad)
        with pytest.raises(InvalidRequest):
            engine.generate([10**7], SamplingParams())
        with pytest.raises(InvalidRequest):
            engine.generate([], SamplingParams())
        with pytest.raises(InvalidRequest):
            engine.generate([1] * 10, SamplingParams(max_tokens=10**6))
        assert engine.memory.num_free == free_before
        assert not engine.scheduler.has_work()

    run(engine, scenario)


def test_scheduler_error_fails_live_requests_and_engine_keeps_serving(model_fp32, monkeypatch):
    engine = make_engine(model_fp32)
    # The second step completes, then a bug surfaces (half-done bookkeeping).
    monkeypatch.setattr(engine.scheduler, "complete",
                        failing_on_call(engine.scheduler.complete, 2,
                                        KeyError("injected scheduler bug"), after=True))

    first, second = run(engine, one_after_another(QUESTIONS[9], QUESTIONS[10]))
    assert first.final.finish_reason == "error" and "injected scheduler bug" in first.final.error
    assert second.final.finish_reason == "length" and len(second.token_ids[0]) == 8
