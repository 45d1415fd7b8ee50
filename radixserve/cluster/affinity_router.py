"""`--router prefix-affinity`: Ray Serve LLM's PrefixCacheAffinityRouter, unchanged, with
radixserve's view bookkeeping (stats, flush and control calls keep working).

It reads the prompt text from `RouteInfo.prompt` (namespace-tagged by the front end so
tenants do not share its tree) and keeps its own prefix tree of what it routed where.
"""

from __future__ import annotations

import time
from typing import Any

from .ray_router import ViewMixin, route_info

AFFINITY_MISSING = ("--router prefix-affinity needs Ray Serve LLM's PrefixCacheAffinityRouter, "
                    "which this Ray does not provide: pip install 'ray[serve,llm]'")

try:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:                  # ray[llm] not installed: the same class, if it ships
    try:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import \
            PrefixCacheAffinityRouter
    except ImportError:
        PrefixCacheAffinityRouter = None


if PrefixCacheAffinityRouter is not None:
    class AffinityRequestRouter(ViewMixin, PrefixCacheAffinityRouter):
        def initialize_state(self, view_key: str = "", block_tokens: int = 16,
                             **kwargs: Any) -> None:
            self.init_view(view_key, block_tokens)
            known = ("imbalanced_threshold", "match_rate_threshold", "do_eviction",
                     "eviction_threshold_chars", "eviction_target_chars",
                     "eviction_interval_secs")
            super().initialize_state(**{k: v for k, v in kwargs.items() if k in known})

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            info = route_info(pending_request)
            pinned = self.pinned(candidate_replicas, info)
            if pinned is not None:
                return pinned
            if info is None or not info.prompt:      # Ray's router divides by len(text)
                return [candidate_replicas]
            start = time.perf_counter()
            chosen = await super().choose_replicas(candidate_replicas, pending_request)
            self.count_decision(time.perf_counter() - start)   # includes its tree actor call
            return chosen
else:
    AffinityRequestRouter = None


def affinity_router_class():
    if AffinityRequestRouter is None:
        raise SystemExit(AFFINITY_MISSING)
    return AffinityRequestRouter
