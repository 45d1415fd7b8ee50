"""Helpers for the --kv-share engine tests: run prompts on an engine, and wrap its store to
slow or hold one of its calls (a test stub for a slow or paused peer)."""

from __future__ import annotations

import asyncio

from engine_helpers import check_pages, collect, wait_idle

from radixserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def serve(engine, prompts, drain=True):
    """Start, run the prompts one after another, wait for the publishes, check pages, stop."""
    async def main():
        await engine.start()
        try:
            out = [await collect(engine.generate(p, GREEDY)) for p in prompts]
            await wait_idle(engine)
            if drain:
                await engine.share_published()
            check_pages(engine)
            return out
        finally:
            await engine.shutdown()
    return asyncio.run(main())


async def until(condition, timeout: float = 60.0) -> None:
    """Wait for `condition()` to hold (an event another thread or engine makes happen);
    `timeout` only turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the awaited event did not happen"
        await asyncio.sleep(0.005)


class StoreWrapper:
    """A SharedStore that forwards every call to `inner`; tests override one call."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.counters = inner.name, inner.counters

    def publish(self, key, payload):
        return self.inner.publish(key, payload)

    def publish_many(self, keys, payloads):
        return self.inner.publish_many(keys, payloads)

    def published(self, keys):
        return self.inner.published(keys)

    def fetch(self, keys):
        return self.inner.fetch(keys)

    def claim(self, keys, owner, ttl_s):
        return self.inner.claim(keys, owner, ttl_s)

    def release_claims(self, keys, owner):
        return self.inner.release_claims(keys, owner)

    def close(self):
        self.inner.close()


def use_store(engine, store) -> None:
    """Put `store` (a StoreWrapper) in front of the engine's store, for every thread."""
    engine.peers.store = engine.peers.publisher.store = store
