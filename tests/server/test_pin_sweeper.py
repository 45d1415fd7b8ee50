"""The pin sweeper releases lapsed TimedPins without traffic: an injected clock and an
injected wait (the test wakes it), no sleeps; and the app runs it from start to shutdown."""

from __future__ import annotations

import asyncio

from radixserve.server.pin_sweeper import PIN_SWEEPER_TASK, PinSweeper
from radixserve.server.timed_pins import TimedPins
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Wake:
    """The sweeper's wait: records what it asked for and returns when the test says."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.go = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self.go.wait()
        self.go.clear()


async def _until(predicate) -> None:
    """Let the sweeper task run until `predicate` holds (event-loop turns, not time)."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the sweeper never got there")


def test_sweeper_waits_for_the_soonest_deadline_and_releases_lapsed_pins():
    async def scenario() -> None:
        engine, clock, wake = FakeEngine(max_model_len=2048), Clock(), Wake()
        pins = TimedPins(engine, ttl_s=60, budget_tokens=1000, clock=clock)
        other = TimedPins(engine, ttl_s=600, budget_tokens=1000, clock=clock)
        early = await pins.take(list(range(3, 40)), None)
        late = await other.take(list(range(50, 90)), None)
        sweeper = PinSweeper([pins, other], max_wait_s=1000, wait=wake)
        task = asyncio.create_task(sweeper.run())
        await _until(lambda: len(wake.asked) == 1)
        assert wake.asked[0] == 60                          # the soonest deadline
        clock.now += 61                                     # no request comes
        wake.go.set()
        await _until(lambda: len(wake.asked) == 2)
        assert early not in pins and late in other
        assert {p.pin_id for p in engine.pinned()} == {late}    # the engine let go too
        assert sweeper.released == 1 and wake.asked[1] == 600 - 61
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        await other.release_all()
        assert engine.pinned() == []

    asyncio.run(scenario())


def test_sweeper_with_nothing_pinned_waits_its_longest_interval():
    sweeper = PinSweeper([TimedPins(FakeEngine(max_model_len=64), 60, 100)], max_wait_s=7)
    assert sweeper.next_wait_s() == 7


def test_the_server_runs_the_sweeper_and_cancels_it_at_shutdown():
    with LiveServer(FakeEngine(max_model_len=2048)) as server:
        task = server.server.runner.app[PIN_SWEEPER_TASK]
        assert not task.done()
    assert task.cancelled()
