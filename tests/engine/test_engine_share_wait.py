"""--kv-share in a burst and under faults: a replica whose prompt a peer is computing waits
for the peer's publication and loads it instead of computing it (the claim); a dead or
aborted claimer does not hold it (the claim expires, or is released); a slow store holds
up no other request's steps (the lookup runs off the event loop), and a stuck one holds a
miss no longer than computing it would take (the lookup's deadline); an abort between a peer
load's order and the step that fills its pages loses nothing. Greedy tokens equal the
cache-off run's (fp32) and pages are conserved after every scenario."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from engine_helpers import check_pages, collect, make_engine, wait_idle
from share_helpers import GREEDY, StoreWrapper, serve, until, use_store

from radixserve.attention.page_bytes import pages_to_bytes
from radixserve.engine.batch import StepBatch
from radixserve.engine.peer_share import (UNMEASURED_LOOKUP_S, PeerLoadOrder, PeerOrders,
                                          PublishOrder)
from radixserve.share.dir_claims import CLAIM_SUFFIX
from radixserve.share.dir_store import DirSharedStore


def engines(model, root, n=2):
    return [make_engine(model, page_size=16, kv_share=f"dir:{root}") for _ in range(n)]


def claims(root):
    return list(root.glob(f"*{CLAIM_SUFFIX}"))


async def finish(*engines_):
    """Idle, every publish in the store, pages conserved."""
    for e in engines_:
        await wait_idle(e)
        await e.share_published()
        check_pages(e)


def run(engines_, gate: threading.Event, scenario):
    """Start the engines, run `scenario()`, finish them; `gate` (what a held store call
    waits on) opens whatever happens, so a failed scenario never hangs the shutdown."""
    async def main():
        for e in engines_:
            await e.start()
        try:
            got = await scenario()
            await finish(*engines_)
            return got
        finally:
            gate.set()
            for e in engines_:
                await e.shutdown()
    return asyncio.run(main())


def test_a_waiter_loads_a_live_peers_pages_however_long_past_its_own_compute_time(
        model_fp32, share_prompts, tmp_path):
    """A computes the prompt and has claimed its pages; its publication is held until B
    has seen the claim and polled the store several times after its own measured time to
    compute the pages ran out (as a busy machine's queued, slow or publishing claimer
    does). The wait ends with the claim, not with that time: B loads every page and
    computes only the rest (before: B stopped waiting and computed the prefix again, as
    three waiters did in bench_cluster's shared-prefix run, 4,216 tokens computed with the
    store against 3,700 without)."""
    ps, expected = share_prompts
    a, b = engines(model_fp32, tmp_path)
    gate = threading.Event()
    polls: list[float] = []

    class HeldPublish(StoreWrapper):
        def publish_many(self, keys, payloads):
            gate.wait()
            return self.inner.publish_many(keys, payloads)

    class CountedPolls(StoreWrapper):
        def claim(self, keys, owner, ttl_s):
            polls.append(time.time())
            return self.inner.claim(keys, owner, ttl_s)

    use_store(a, HeldPublish(a.peers.store))
    use_store(b, CountedPolls(b.peers.store))
    a.peers.costs.prefill_s_per_token = 60.0 / len(ps[0])   # A's claim: minutes long
    b.peers.costs.prefill_s_per_token = 1e-9                # B computes it "at once"

    async def scenario():
        ta = asyncio.create_task(collect(a.generate(ps[0], GREEDY)))
        await until(lambda: claims(tmp_path))       # A claimed the prompt's pages
        tb = asyncio.create_task(collect(b.generate(ps[0], GREEDY)))
        await until(lambda: b.peers.stats().waits == 1)     # B saw the claim: waits
        seen = len(polls)
        await until(lambda: len(polls) >= seen + 3)         # ... and goes on polling
        assert b.peers.stats().loaded_tokens == 0 and not tb.done()
        gate.set()
        return await ta, await tb

    ra, rb = run((a, b), gate, scenario)
    assert ra.token_ids[0] == rb.token_ids[0] == expected[0]
    pages = (len(ps[0]) - 1) // 16
    sb = b.stats().share
    assert sb.waits == 1 and sb.waits_expired == 0 and sb.wait_seconds > 0
    assert sb.loaded_tokens == pages * 16
    assert rb.final.usage.cached_tokens == pages * 16       # computed only the rest
    assert a.stats().share.claimed_pages == pages and sb.claimed_pages == 0
    assert not claims(tmp_path)                             # every claim released


def test_a_claimers_claims_are_renewed_while_its_prefill_progresses(model_fp32,
                                                                     share_prompts, tmp_path):
    """A computes the prompt in chunks of 16 tokens; every chunk that leaves its claims
    past half their life (here: at once) renews them in the store, with the same keys and
    owner, and so does the end of the prefill (before the publish, however slow), before
    they are released by the publication."""
    ps, expected = share_prompts
    a = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}",
                    chunked_prefill_size=16)
    calls: list[tuple] = []             # the store's calls, in order (publisher thread)

    class Recorded(StoreWrapper):
        def claim(self, keys, owner, ttl_s):
            calls.append((tuple(keys), owner))
            return self.inner.claim(keys, owner, ttl_s)

        def publish_many(self, keys, payloads):
            calls.append("publish")
            return self.inner.publish_many(keys, payloads)

    use_store(a, Recorded(a.peers.store))
    a.peers.costs.prefill_s_per_token = 1e-9        # claims of MIN_CLAIM_S ...
    progress, chunks = a.peers.progress, []

    def due_at_once(seq):                           # ... that are due for renewal at once
        if seq.share is not None and seq.share.claimed:
            seq.share.renew_at = 0.0
            chunks.append(seq.num_computed)
        progress(seq)

    a.peers.progress = due_at_once
    (result,) = serve(a, ps[:1])
    assert result.token_ids[0] == expected[0]
    pages = (len(ps[0]) - 1) // 16
    first, *renewals, published = calls
    assert len(first[0]) == pages and chunks and published == "publish"
    # one renewal per chunk computed while claimed, and one as the prefill ended
    assert renewals == [first] * (len(chunks) + 1)
    assert not claims(tmp_path)                     # released once published


def test_a_slow_poll_during_a_wait_does_not_turn_the_load_into_a_recompute(
        model_fp32, share_prompts, tmp_path):
    """B has measured no prefill yet (a replica's first prompt: its lookups' deadline is
    the unmeasured floor, 1 s) and waits on A's claim. One of B's polls is held past that
    floor (a busy machine, a busy store): the poll may take until the wait's end, so B
    still loads A's pages once they are published (before: the poll counted as late and
    B computed the whole prefix, as each replica did in bench_cluster's few-shot run)."""
    ps, expected = share_prompts
    a = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}")
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}",
                    kv_share_lookup_min_s=0.0)
    gate, poll = threading.Event(), threading.Event()
    held_at: list[float] = []

    class HeldPublish(StoreWrapper):        # A: a claim that outlasts the test, held publish
        def claim(self, keys, owner, ttl_s):
            return self.inner.claim(keys, owner, 3600.0)

        def publish_many(self, keys, payloads):
            gate.wait()
            return self.inner.publish_many(keys, payloads)

    class HeldPoll(StoreWrapper):           # B: once armed, its next lookup is held
        armed = False

        def published(self, keys):
            if self.armed:
                self.armed = False
                held_at.append(time.monotonic())
                poll.wait()
            return self.inner.published(keys)

    use_store(a, HeldPublish(a.peers.store))
    use_store(b, held := HeldPoll(b.peers.store))
    assert b.peers.costs.prefill_s_per_token is None

    async def scenario():
        ta = asyncio.create_task(collect(a.generate(ps[0], GREEDY)))
        await until(lambda: claims(tmp_path))       # A claimed the prompt's pages
        tb = asyncio.create_task(collect(b.generate(ps[0], GREEDY)))
        await until(lambda: b.peers.stats().waits == 1)     # B saw the claim: waits
        held.armed = True
        await until(lambda: held_at)                # one of B's polls is held
        look = b.peers.lookups.current
        assert look is not None and look.deadline - time.monotonic() > 100 * UNMEASURED_LOOKUP_S
        await until(lambda: time.monotonic() > held_at[0] + UNMEASURED_LOOKUP_S)
        gate.set()                                  # A publishes ...
        await until(lambda: a.peers.publisher.queued == 0)
        poll.set()                                  # ... and B's poll goes on: it loads
        return await ta, await tb

    try:
        ra, rb = run((a, b), gate, scenario)
    finally:
        poll.set()
    assert ra.token_ids[0] == rb.token_ids[0] == expected[0]
    sb = b.stats().share
    assert sb.lookups_late == 0 and sb.waits_expired == 0
    assert sb.loaded_tokens == (len(ps[0]) - 1) // 16 * 16
    assert not claims(tmp_path)


def test_a_dead_claimers_claim_expires_and_the_waiter_computes(model_fp32, share_prompts,
                                                               tmp_path):
    """The claim of a replica that died is never released: B waits until its deadline,
    then takes it over, computes, publishes and releases it."""
    ps, expected = share_prompts
    (b,) = engines(model_fp32, tmp_path, 1)
    pages = (len(ps[0]) - 1) // 16
    keys = b.peers.keys(ps[0], pages, None)
    assert DirSharedStore(tmp_path, 1 << 20).claim(keys, "a-dead-replica", 0.3).claimed \
        == pages
    (result,) = serve(b, ps[:1])
    assert result.token_ids[0] == expected[0]
    s = b.stats().share
    assert s.waits == 1 and s.waits_expired == 1 and s.loaded_tokens == 0
    assert result.final.usage.cached_tokens == 0
    assert s.claimed_pages == pages and s.published_pages == pages
    assert not claims(tmp_path)


def test_an_aborted_claimers_claims_go_and_the_waiter_computes(model_fp32, share_prompts,
                                                               tmp_path):
    """A's request is aborted while its lookup (which claimed the pages) is answered:
    the claims are released, and B, waiting on them, computes at once (no expiry)."""
    ps, expected = share_prompts
    a, b = engines(model_fp32, tmp_path)
    claimed, gate = threading.Event(), threading.Event()

    class HeldClaim(StoreWrapper):
        def claim(self, keys, owner, ttl_s):
            got = self.inner.claim(keys, owner, ttl_s)
            claimed.set()
            gate.wait()
            return got

    use_store(a, HeldClaim(a.peers.store))

    async def scenario():
        ta = asyncio.create_task(collect(a.generate(ps[0], GREEDY, request_id="a")))
        await until(claimed.is_set)
        tb = asyncio.create_task(collect(b.generate(ps[0], GREEDY)))
        await until(lambda: b.peers.stats().waits == 1)
        a.abort("a")
        await until(lambda: a.scheduler.num_live == 0)
        gate.set()
        return await ta, await tb

    ra, rb = run((a, b), gate, scenario)
    assert ra.final.finish_reason == "abort"
    assert rb.token_ids[0] == expected[0]
    sb = b.stats().share
    assert sb.waits == 1 and sb.waits_expired == 0 and sb.loaded_tokens == 0
    assert rb.final.usage.cached_tokens == 0
    assert not claims(tmp_path)


def test_a_slow_store_holds_up_no_other_requests_steps(model_fp32, share_prompts, tmp_path):
    """The store's answer to one admission is held; a request the pool serves runs all its
    steps meanwhile; once the store answers, the held request completes."""
    ps, expected = share_prompts
    (b,) = engines(model_fp32, tmp_path, 1)
    asked, gate = threading.Event(), threading.Event()

    class HeldLookup(StoreWrapper):
        armed = False

        def published(self, keys):
            if self.armed:
                asked.set()
                gate.wait()
            return self.inner.published(keys)

    use_store(b, store := HeldLookup(b.peers.store))

    async def scenario():
        await collect(b.generate(ps[0], GREEDY))        # now in B's pool
        await wait_idle(b)
        store.armed = True
        # The same prompt in another namespace: a pool miss, so the store is asked.
        held = asyncio.create_task(collect(b.generate(ps[0], GREEDY, namespace="t2")))
        await until(asked.is_set)                       # its lookup is in the store
        other = await collect(b.generate(ps[0], GREEDY))
        assert not held.done() and not gate.is_set()
        gate.set()
        return other, await held

    other, held = run((b,), gate, scenario)
    assert other.token_ids[0] == held.token_ids[0] == expected[0]
    assert len(other.token_ids[0]) == GREEDY.max_tokens


class StuckLookup(StoreWrapper):
    """Once `armed`, the store's lookup blocks until `gate` opens: in `published` (before
    anything is claimed), or with `after_claim`, in `claim` once its claims are made."""

    def __init__(self, inner, after_claim: bool = False):
        super().__init__(inner)
        self.armed = False
        self.after_claim = after_claim
        self.gate = threading.Event()
        self.asked: list = []

    def _hold(self, keys):
        if self.armed:
            self.asked.append(keys)
            self.gate.wait()

    def published(self, keys):
        if not self.after_claim:
            self._hold(keys)
        return self.inner.published(keys)

    def claim(self, keys, owner, ttl_s):
        if self.after_claim:            # claims that outlast the test: only a release ends them
            ttl_s = 3600.0
        claim = self.inner.claim(keys, owner, ttl_s)
        if self.after_claim:
            self._hold(keys)
        return claim


def test_a_stuck_store_holds_a_miss_no_longer_than_computing_it(model_fp32, share_prompts,
                                                                tmp_path):
    """The store stops answering (its lookup blocks until the test lets it go). A pool miss
    waits for its lookup only as long as computing its pages takes (measured on the first
    prompt), then computes them; a miss while the lookup is still stuck does not queue
    behind it (the store is not asked). The late answer is dropped: nothing loaded, its
    claims released, pages conserved."""
    ps, expected = share_prompts
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}",
                    kv_share_lookup_min_s=0.0)
    use_store(b, store := StuckLookup(b.peers.store))
    gate, asked = store.gate, store.asked

    async def scenario():
        await collect(b.generate(ps[0], GREEDY))        # measures the prefill; in the pool
        await wait_idle(b)
        assert b.peers.costs.prefill_s_per_token is not None
        store.armed = True
        late = await collect(b.generate(ps[0], GREEDY, namespace="t2"))    # a pool miss
        assert len(asked) == 1 and not gate.is_set()    # served while the store is stuck
        skipped = await collect(b.generate(ps[1], GREEDY, namespace="t3"))
        assert len(asked) == 1 and not gate.is_set()    # not queued behind the stuck one
        gate.set()
        await asyncio.to_thread(b.peers.lookups.drain)  # the late answer comes, dropped
        return late, skipped

    late, skipped = run((b,), gate, scenario)
    assert late.token_ids[0] == expected[0] and skipped.token_ids[0] == expected[1]
    assert late.final.usage.cached_tokens == skipped.final.usage.cached_tokens == 0
    s = b.stats().share
    assert s.lookups_late == 2 and s.loaded_tokens == 0
    assert not claims(tmp_path)


def test_an_abort_between_a_peer_load_and_its_fill_loses_nothing(model_fp32, share_prompts,
                                                                share_published):
    """The request that loaded a peer's pages (in the tree, bytes not yet written) is
    aborted before the step that writes them runs; the pages are conserved, and a later
    request reading them from the pool gets the cache-off run's tokens."""
    ps, expected = share_prompts
    (b,) = engines(model_fp32, share_published, 1)
    execute = b.runner.execute
    seen = []

    async def main():
        loop = asyncio.get_running_loop()

        def abort_first(batch):         # on the compute thread, before the step runs
            if batch.peer is not None and batch.peer.loads and not seen:
                seen.append(batch)
                asyncio.run_coroutine_threadsafe(aborted(), loop).result()
            return execute(batch)

        async def aborted():
            b.abort("first")

        b.runner.execute = abort_first
        await b.start()
        try:
            first = await collect(b.generate(ps[0], GREEDY, request_id="first"))
            await wait_idle(b)
            check_pages(b)
            later = await collect(b.generate(ps[0], GREEDY))
            await finish(b)
            return first, later
        finally:
            await b.shutdown()

    first, later = asyncio.run(main())
    assert seen and first.final.finish_reason == "abort"
    pages = (len(ps[0]) - 1) // 16
    assert b.stats().share.loaded_tokens == pages * 16      # loaded once, by the first
    assert later.final.usage.cached_tokens == pages * 16
    assert later.token_ids[0] == expected[0]


def test_a_step_that_fails_before_a_peer_load_still_fills_its_pages(model_fp32):
    """Peer-loaded pages join the tree at admission; the step that writes their bytes must
    write them even when something before it in that step raises (here a publish)."""
    b = make_engine(model_fp32, page_size=16)
    pool = b.runner.kv_pool
    src, dst = np.array([1, 2]), np.array([5, 6])
    payloads = tuple(bytes((i * 7 + j) % 251 for j in range(len(p)))
                     for i, p in enumerate(pages_to_bytes(pool, src)))

    class Broken:
        def submit(self, *args):
            raise OSError("the publisher failed")

    b.runner.share_publisher = Broken()
    batch = StepBatch(peer=PeerOrders(publish=[PublishOrder((b"k" * 16,), src)],
                                      loads=[PeerLoadOrder(dst, payloads)]))
    with pytest.raises(OSError, match="publisher failed"):
        b.runner.execute(batch)
    assert tuple(pages_to_bytes(pool, dst)) == payloads


def test_a_stuck_store_does_not_hold_the_engines_shutdown(model_fp32, share_prompts, tmp_path,
                                                         caplog):
    """The lookup thread is inside a store call (after claiming the prompt's pages) that has
    not returned when the engine shuts down: shutdown waits for it only `close_wait_s`,
    warns, and returns. When the call returns later, the claims it made are released (the
    publisher is gone: by the lookup thread itself); pages were conserved before shutdown."""
    ps, expected = share_prompts
    b = make_engine(model_fp32, page_size=16, kv_share=f"dir:{tmp_path}",
                    kv_share_lookup_min_s=0.0)
    use_store(b, store := StuckLookup(b.peers.store, after_claim=True))
    b.peers.close_wait_s = 0.05

    async def main():
        await b.start()
        try:
            store.armed = True
            late = await collect(b.generate(ps[0], GREEDY))     # its lookup is stuck
            await wait_idle(b)
            check_pages(b)
            await asyncio.wait_for(b.shutdown(), 60)    # the bound turns a hang into a failure
            assert not store.gate.is_set() and b.peers.lookups.alive   # returned while stuck
            assert claims(tmp_path)     # the stuck lookup's claims, still held
            return late
        finally:
            store.gate.set()

    late = asyncio.run(main())
    assert late.token_ids[0] == expected[0]
    assert len(store.asked) == 1
    assert "did not answer a lookup" in caplog.text
    b.peers.lookups.close()             # its call returned (the gate opened): thread ends
    assert not b.peers.lookups.alive
    assert not claims(tmp_path)         # ... and released them
