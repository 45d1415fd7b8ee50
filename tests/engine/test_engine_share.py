"""--kv-share in the engine: a prompt one engine computed is loaded by another from the
cluster store (a shared directory here; two engines stand for two replicas) and gives the
same greedy tokens as computing it (fp32); a damaged page is refused and recomputed; a
store slower than computing stops being used. Pages are conserved after every scenario."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_helpers import QUESTIONS, chat_ids, check_pages, collect, make_engine, wait_idle

from prometheus_client import generate_latest

from radixserve.cluster.client import sum_stats
from radixserve.engine.sampling_params import SamplingParams
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import stats_body
from radixserve.share.dir_store import SUFFIX

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


@pytest.fixture(scope="module")
def prompts(model_fp32):
    engine = make_engine(model_fp32, disable_radix_cache=True)
    ps = [chat_ids(engine, q) for q in QUESTIONS[:2]]
    expected = [r.token_ids[0] for r in serve(engine, ps, drain=False)]
    return ps, expected


@pytest.fixture(scope="module")
def published(model_fp32, prompts, tmp_path_factory):
    """A directory holding the pages engine A computed for the first prompt."""
    root = tmp_path_factory.mktemp("share")
    a = make_engine(model_fp32, page_size=16, kv_share=f"dir:{root}")
    serve(a, prompts[0][:1])
    assert a.stats().share.published_pages == (len(prompts[0][0]) - 1) // 16
    return root


def test_a_peer_computed_prefix_is_loaded_not_recomputed(model_fp32, prompts, published):
    ps, expected = prompts
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{published}")
    results = serve(b, ps)
    assert [r.token_ids[0] for r in results] == expected
    share = b.stats().share
    pages = (len(ps[0]) - 1) // 16
    assert share.loaded_tokens >= pages * 16 and share.refused_pages == 0
    assert results[0].final.usage.cached_tokens == pages * 16
    # The second prompt shares the system prompt: B's own pool serves that part now.
    assert results[1].final.usage.cached_tokens > 0
    assert share.bytes_fetched > 0 and share.load_s_per_token is not None
    # The views: /cache/stats, /metrics, and a cluster's total over replicas.
    body = stats_body(b.stats())["share"]
    assert body["loaded_tokens"] == share.loaded_tokens and body["store"] == "dir"
    text = generate_latest(ServerMetrics(b.stats).registry).decode()
    assert f"radixserve_kv_share_loaded_tokens_total {float(share.loaded_tokens)}" in text
    assert "radixserve_kv_share_refused_pages_total 0.0" in text
    total = sum_stats([b.stats(), b.stats()]).share
    assert total.loaded_tokens == 2 * share.loaded_tokens and share.loads == 1


def test_a_damaged_page_is_refused_and_recomputed(model_fp32, prompts, tmp_path):
    ps, expected = prompts
    a = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}")
    serve(a, ps[:1])
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    assert files
    for f in files:                             # every page damaged
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}")
    results = serve(b, ps[:1])
    assert [r.token_ids[0] for r in results] == expected[:1]
    share = b.stats().share
    assert share.refused_pages == 1 and share.loaded_tokens == 0
    assert results[0].final.usage.cached_tokens == 0


class SlowStore:
    """A store that answers correctly but takes `delay` per fetch."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.name, self.counters = inner.name, inner.counters
        self.fetches = 0

    def publish(self, key, payload):
        return self.inner.publish(key, payload)

    def published(self, keys):
        return self.inner.published(keys)

    def fetch(self, keys):
        self.fetches += 1
        time.sleep(self.delay)
        return self.inner.fetch(keys)

    def close(self):
        self.inner.close()


def test_a_store_slower_than_computing_is_not_used(model_fp32, prompts, published):
    """The first load measures the store (slow); once its cost per token is above
    computing's, a miss recomputes and the store is not asked for pages again."""
    ps, expected = prompts
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{published}")
    b.peers.store = slow = SlowStore(b.peers.store, delay=0.5)
    # Computing the whole prompt is taken to cost 0.2 s, so a fetch of any part of it that
    # takes >= 0.5 s is slower per token whatever the machine's speed (the first request's
    # own prefill, under 32 tokens after the load, is not measured).
    b.peers.costs.prefill_s_per_token = 0.2 / len(ps[0])

    async def main():
        await b.start()
        try:
            first = await collect(b.generate(ps[0], GREEDY))
            await wait_idle(b)
            await b.flush_cache()                   # B misses the prefix again
            second = await collect(b.generate(ps[0], GREEDY))
            await wait_idle(b)
            check_pages(b)
            return first, second
        finally:
            await b.shutdown()

    first, second = asyncio.run(main())
    assert first.token_ids[0] == second.token_ids[0] == expected[0]
    assert slow.fetches == 1                        # measured once, then left alone
    share = b.stats().share
    assert share.skipped_slow == 1 and second.final.usage.cached_tokens == 0
    assert b.peers.costs.peer_s_per_token >= 0.5 / len(ps[0])


def test_two_engines_publish_the_same_prefix_at_once(model_fp32, prompts, tmp_path):
    """Both compute and publish the same prompt concurrently: one copy of each page stays,
    both serve correctly, and a third engine loads the prefix from it."""
    ps, expected = prompts
    a, b = (make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}")
            for _ in range(2))

    async def both():
        await a.start()
        await b.start()
        try:
            got = await asyncio.gather(collect(a.generate(ps[0], GREEDY)),
                                       collect(b.generate(ps[0], GREEDY)))
            for e in (a, b):
                await wait_idle(e)
                await e.share_published()
                check_pages(e)
            return got
        finally:
            await a.shutdown()
            await b.shutdown()

    got = asyncio.run(both())
    assert [g.token_ids[0] for g in got] == [expected[0]] * 2
    pages = (len(ps[0]) - 1) // 16
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == pages
    sa, sb = a.stats().share, b.stats().share
    assert pages <= sa.published_pages + sb.published_pages <= 2 * pages
    c = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}")
    results = serve(c, ps[:1])
    assert results[0].token_ids[0] == expected[0]
    assert c.stats().share.loaded_tokens == pages * 16
