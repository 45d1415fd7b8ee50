"""An internal failure stops the engine loudly (issue 20, item 8); the queue cap counts
requests (item 9)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine_helpers import QUESTIONS, chat_ids, collect, make_engine, wait_idle
from radixserve.engine.errors import EngineUnhealthy, QueueFull
from radixserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def run(engine, scenario):
    async def main():
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def until(condition, what: str, timeout: float = 60.0) -> None:
    """Wait for the engine loop to reach a state (polled each loop turn; the timeout is a
    hang guard only)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.005)


def test_failed_invariant_check_marks_the_engine_unhealthy(model_fp32, caplog):
    engine = make_engine(model_fp32)        # debug_invariants: checked whenever idle

    def broken():
        raise AssertionError("page conservation violated: injected")

    async def scenario(engine):
        first = await collect(engine.generate(chat_ids(engine, QUESTIONS[0]), PARAMS))
        assert engine.healthy and engine.error is None
        engine.check_invariants = broken
        second = await collect(engine.generate(chat_ids(engine, QUESTIONS[1]), PARAMS))
        await until(lambda: not engine.healthy, "the engine never reported the failure")
        with pytest.raises(EngineUnhealthy, match="injected"):
            engine.generate(chat_ids(engine, QUESTIONS[2]), PARAMS)
        return first, second

    with caplog.at_level(logging.CRITICAL, logger="radixserve.engine.engine"):
        first, second = run(engine, scenario)
    assert first.final.finish_reason == second.final.finish_reason == "length"
    assert "injected" in engine.error
    assert any("engine stopped" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_failure_escaping_step_handling_fails_live_requests(model_fp32, monkeypatch):
    engine = make_engine(model_fp32)

    def forward_fails(batch):
        raise RuntimeError("injected forward failure")

    def cleanup_fails(plan, error):
        raise KeyError("injected bookkeeping bug")

    monkeypatch.setattr(engine.runner, "execute", forward_fails)
    monkeypatch.setattr(engine.core, "fail_step", cleanup_fails)

    async def scenario(engine):
        streams = [engine.generate(chat_ids(engine, q), PARAMS) for q in QUESTIONS[3:5]]
        results = await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 60)
        await wait_idle(engine)
        engine.check_invariants()            # failing them still returned every page
        return results

    results = run(engine, scenario)
    for got in results:
        assert got.final.finish_reason == "error" and "injected bookkeeping bug" in got.final.error
    assert not engine.healthy and "injected bookkeeping bug" in engine.error


def test_queue_cap_counts_requests_not_samples(model_fp32):
    engine = make_engine(model_fp32, max_queue_len=2)
    params = SamplingParams(max_tokens=2, temperature=0.5, n=3)

    async def scenario(engine):
        prompt = chat_ids(engine, QUESTIONS[5])
        # The loop has not run yet: all of these wait.
        streams = [engine.generate(prompt, params) for _ in range(2)]     # 6 samples
        with pytest.raises(QueueFull, match="^2 requests are waiting"):
            engine.generate(prompt, params)
        results = await asyncio.gather(*map(collect, streams))
        await wait_idle(engine)
        engine.check_invariants()
        return results

    assert all(sorted(r.finals) == [0, 1, 2] for r in run(engine, scenario))
