"""Helpers for engine tests: build an engine, run requests to completion, collect outputs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams

SYSTEM_PROMPT = (
    "You are a meticulous assistant for a travel company. Answer in one short sentence, "
    "name the city and country, never invent facts, and prefer metric units. "
    "Our customers ask about capitals, rivers, mountains and famous buildings. "
) * 3

QUESTIONS = [
    "What is the capital of France?", "What is the capital of Japan?",
    "Which river flows through Cairo?", "How tall is Mount Everest?",
    "Where is the Colosseum?", "What is the capital of Canada?",
    "Which city has the Sagrada Familia?", "What is the longest river in Europe?",
    "Where is the Eiffel Tower?", "What is the capital of Australia?",
    "Which country is Lisbon in?", "Where is Machu Picchu?",
    "What is the capital of Kenya?", "Which city is called the Big Apple?",
    "What is the highest mountain in Africa?", "Where is the Taj Mahal?",
]


@dataclass
class Collected:
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finals: dict[int, object] = field(default_factory=dict)

    @property
    def final(self):
        return self.finals[0]


def make_engine(loaded, **overrides) -> Engine:
    # kv_share_lookup_min_s: a busy machine must not turn a store's load into a recompute
    # (a lookup's deadline); the test of that deadline sets its own.
    config = EngineConfig(**{"kv_cache_tokens": 16384, "chunked_prefill_size": 512,
                             "debug_invariants": True, "warmup_tokens": 0,
                             "kv_share_lookup_min_s": 600.0, **overrides})
    return Engine(config, loaded)


async def collect(stream) -> Collected:
    got = Collected()
    async for out in stream:
        got.token_ids.setdefault(out.index, []).extend(out.token_ids)
        got.text[out.index] = got.text.get(out.index, "") + out.text
        if out.finished:
            got.finals[out.index] = out
    return got


def chat_ids(engine: Engine, question: str, system: str = SYSTEM_PROMPT) -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}])


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams,
            stagger: float = 0.0, collector=None) -> list:
    """Start the engine, run every prompt concurrently, check conservation, shut down.
    `collector(stream)` gathers one request's outputs (default: `collect`)."""
    collector = collector or collect

    async def main():
        await engine.start()
        try:
            tasks = []
            for p in prompts:
                tasks.append(asyncio.create_task(collector(engine.generate(p, params))))
                if stagger:
                    await asyncio.sleep(stagger)
            results = await asyncio.gather(*tasks)
            await wait_idle(engine)
            engine.check_invariants()
            return results
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def wait_idle(engine: Engine, timeout: float = 300.0) -> None:
    """Until the scheduler has nothing left; the timeout is a backstop for a hang, far
    above any busy machine's pace (pytest's own timeout is 600 s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.scheduler.has_work():
        if loop.time() > deadline:
            raise TimeoutError("engine did not go idle")
        await asyncio.sleep(0.01)


def loads_unmeasured(engine: Engine) -> Engine:
    """Loads from host memory and disk are no longer timed, so the engine always loads
    rather than recomputes: for tests of what a load brings back. On a busy machine a
    reader thread kept waiting makes one load look slower than computing, and the measured
    choice (engine/tier_costs.py, tested in test_tier_costs.py and test_slow_disk.py)
    would then rightly recompute."""
    engine.tiers.costs.observe_load = lambda tier, tokens, seconds: None
    return engine


def check_pages(engine: Engine) -> None:
    """Conservation (free + tree + private == total, checked id by id), with no request
    live: free + tree == total."""
    engine.check_invariants()
    assert engine.memory.num_free + engine.tree.total_tokens // engine.page_size \
        == engine.runner.num_pages
    windows = getattr(engine.memory, "windows", None)    # per-group pools (hybrid models)
    if windows is not None:
        in_tree = int(windows.present(engine.memory.tree_ids()).sum())   # + lower tiers
        assert windows.num_free + in_tree == windows.num_pages == engine.runner.window_pages


def run_scenario(engine: Engine, scenario, check=check_pages):
    """Run `scenario(engine)` on a started engine; once idle, end with `check(engine)`."""

    async def main():
        await engine.start()
        try:
            result = await scenario(engine)
            await wait_idle(engine)
            check(engine)
            return result
        finally:
            await engine.shutdown()

    return asyncio.run(main())
