"""A prompt_cache_key as the routing key: the cache-aware router breaks ties by it and the
consistent-hash router hashes it, so requests with one key meet on one replica whatever
their first page, and requests without one keep the first-page behaviour."""

from __future__ import annotations

from radixserve.routing.routers import (CacheAwareRouter, ConsistentHashRouter, RouteRequest,
                                        cache_key_hash)


class IdleView:
    num_replicas = 8

    def queued_requests(self):
        return [0] * 8

    def queued_seconds(self):
        return [0.0] * 8

    def cached_tokens(self, request):
        return [0] * 8

    def settled(self, request):
        return [True] * self.num_replicas


def test_one_key_one_replica_whatever_the_prompt():
    view = IdleView()
    key = cache_key_hash("conversation-42")
    for router in (CacheAwareRouter(8, 1e-4), ConsistentHashRouter(8)):
        keyed = {router.choose(RouteRequest([first, 7], 100, key), view) for first in range(50)}
        assert len(keyed) == 1
        unkeyed = {router.choose(RouteRequest([first, 7], 100), view) for first in range(50)}
        assert len(unkeyed) > 1         # without a key: spread by the first page
    assert cache_key_hash(None) is None
    assert cache_key_hash("a") == cache_key_hash("a") != cache_key_hash("b")
