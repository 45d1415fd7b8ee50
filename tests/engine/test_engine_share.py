"""--kv-share in the engine: a prompt one engine computed is loaded by another from the
cluster store (a shared directory here; two engines stand for two replicas) and gives the
same greedy tokens as computing it (fp32); a damaged page is refused and recomputed; a
store slower than computing stops being used. Pages are conserved after every scenario."""

from __future__ import annotations

import asyncio
import time

from engine_helpers import check_pages, collect, make_engine, wait_idle
from share_helpers import GREEDY, StoreWrapper, serve, use_store

from prometheus_client import generate_latest

from radixserve.cluster.client import sum_stats
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import stats_body
from radixserve.share.dir_store import SUFFIX


def test_a_peer_computed_prefix_is_loaded_not_recomputed(model_fp32, share_prompts,
                                                        share_published):
    ps, expected = share_prompts
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{share_published}")
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


def test_a_damaged_page_is_refused_and_recomputed(model_fp32, share_prompts, tmp_path):
    ps, expected = share_prompts
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


class SlowStore(StoreWrapper):
    """A store that answers correctly but takes `delay` per fetch."""

    def __init__(self, inner, delay: float):
        super().__init__(inner)
        self.delay = delay
        self.fetches = 0

    def fetch(self, keys):
        self.fetches += 1
        time.sleep(self.delay)
        return self.inner.fetch(keys)


def test_a_store_slower_than_computing_is_not_used(model_fp32, share_prompts,
                                                  share_published):
    """The first load measures the store (slow); once its cost per token is above
    computing's, a miss recomputes and the store is not asked for pages again."""
    ps, expected = share_prompts
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{share_published}")
    use_store(b, slow := SlowStore(b.peers.store, delay=0.5))
    # Computing the whole prompt is taken to cost 0.2 s, so a fetch of any part of it that
    # takes >= 0.5 s is slower per token whatever the machine's speed (the first request's
    # own prefill, under 32 tokens after the load, is not measured).
    b.peers.costs.prefill_s_per_token = 0.2 / len(ps[0])
    b.peers.costs.clock = lambda: 0.0   # no probe of the slow store (tier_costs.PROBE_AFTER_S)

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


def test_two_engines_publish_the_same_prefix_at_once(model_fp32, share_prompts, tmp_path):
    """Both compute and publish the same prompt concurrently: one copy of each page stays,
    both serve correctly, and a third engine loads the prefix from it."""
    ps, expected = share_prompts
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
