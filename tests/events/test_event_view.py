"""--router-view events: the cluster router's view of a replica built from its KV events
(cluster/event_feed.py) says what the replica's digest says, and what its tree matches.
No Ray: the replica side is a real tree and publisher, the router side the real
ClusterState the Ray router reads."""

from __future__ import annotations

import statistics

from radixserve.cache import PagedMemory, RadixCache
from radixserve.cluster.cache_digest import DigestMaker
from radixserve.cluster.event_feed import EventFeed
from radixserve.cluster.prefix_hashes import matched_blocks, prompt_hashes
from radixserve.cluster.view import ClusterState
from radixserve.events.stream import KVEvents, KVEventsConfig
from tests.events.conftest import LOCAL
from tests.events.test_golden import run

BLOCK = 16


def test_event_view_matches_digest_and_tree():
    tree = RadixCache(page_size=1)
    mem = PagedMemory(600, tree)
    events = KVEvents(tree, KVEventsConfig(LOCAL, LOCAL, block_size=BLOCK), "cpu")
    state = ClusterState(BLOCK)
    feed = EventFeed(state)
    state.event_source = feed
    meta = {"endpoint": events.publisher.endpoint,
            "replay_endpoint": events.publisher.replay_endpoint, "block_size": BLOCK,
            "topic": "", "encoding": "array", "dp_rank": 0}
    state.published("replica-0", {"kv_event_metadata": meta, "stats": None})
    system = list(range(500, 560))                  # 3 whole blocks and a part
    prompts = [system + [i] * 40 for i in range(12)] + [[9] * 70]
    try:
        assert feed.wait_applied(1, timeout_s=30)      # caught up: the AllBlocksCleared
        feed.lag_seconds.clear()
        for i, p in enumerate(prompts):                 # one batch at a time: the live lag
            run(tree, mem, p, "tenant" if i % 3 == 0 else None)
            events.flush()
            assert feed.wait_applied(events.publisher.sent_when_idle(), timeout_s=30)
        mem.free(tree.evict(200))
        events.flush()
        assert feed.wait_applied(events.publisher.sent_when_idle(), timeout_s=30)
        digest = DigestMaker(tree, BLOCK).digest()
        replica = state.replicas["replica-0"]
        for i, p in enumerate(prompts):
            for ns in (None, "tenant"):
                hashes = prompt_hashes(p, BLOCK, ns)
                want = tree.peek_prefix(p, ns) // BLOCK
                assert replica.held_blocks(hashes) == want
                assert matched_blocks(hashes, digest.hashes) == want
        assert replica.digest.hashes == digest.hashes   # the same set as the tree walk
        print(f"event view lag: median {statistics.median(feed.lag_seconds) * 1e3:.2f} ms, "
              f"max {max(feed.lag_seconds) * 1e3:.2f} ms over {len(feed.lag_seconds)} "
              f"batches; a digest walk: {digest.walk_seconds * 1e3:.2f} ms")
        assert len(feed.lag_seconds) == events.publisher.sent_when_idle() - 1
    finally:
        feed.close()
        events.close()
