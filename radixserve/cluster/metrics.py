"""Prometheus metrics of a replicated server: each replica's engine counters with a
`replica` label, and the router's own (decisions, their cost, its view of each replica).

The unlabelled `radixserve_*` families keep meaning the whole server (the sum over the
replicas), so single-engine dashboards work unchanged; `radixserve_replica_*` split them.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.engine.outputs import EngineStats

from .view import ClusterState

_REPLICA_COUNTERS = (
    ("radixserve_replica_prefix_cache_queries_tokens", "Prompt tokens looked up, per replica",
     "prefix_query_tokens"),
    ("radixserve_replica_prefix_cache_hits_tokens", "Prompt tokens found cached, per replica",
     "prefix_hit_tokens"),
    ("radixserve_replica_prompt_tokens", "Prompt tokens admitted, per replica", "prompt_tokens"),
    ("radixserve_replica_generation_tokens", "Generated tokens, per replica",
     "generation_tokens"),
    ("radixserve_replica_evicted_tokens", "Tokens evicted, per replica", "evicted_tokens"),
)
_REPLICA_GAUGES = (
    ("radixserve_replica_running_requests", "Requests being computed, per replica", "running"),
    ("radixserve_replica_waiting_requests", "Requests waiting, per replica", "waiting"),
    ("radixserve_replica_kv_pages_free", "Free KV pages, per replica", "pages_free"),
    ("radixserve_replica_kv_pages_cached", "KV pages held by the cache, per replica",
     "pages_cached"),
    ("radixserve_replica_kv_pages_total", "KV pages in the pool, per replica", "pages_total"),
)


class ClusterCollector(Collector):
    def __init__(self, replica_stats: Callable[[], dict[str, EngineStats]], state: ClusterState):
        self._replica_stats = replica_stats
        self._state = state

    def collect(self) -> Iterator[Metric]:
        stats = self._replica_stats()
        for table, family in ((_REPLICA_COUNTERS, CounterMetricFamily),
                              (_REPLICA_GAUGES, GaugeMetricFamily)):
            for name, doc, attr in table:
                metric = family(name, doc, labels=["replica"])
                for rid, s in stats.items():
                    metric.add_metric([rid], getattr(s, attr))
                yield metric
        yield from self._share_metrics(stats)
        yield from self._router_metrics()

    @staticmethod
    def _share_metrics(stats: dict[str, EngineStats]) -> Iterator[Metric]:
        """--kv-share per replica: prompt tokens loaded from peers, bytes both ways."""
        for attr in ("loaded_tokens", "bytes_fetched", "bytes_published", "published_pages",
                     "refused_pages", "load_seconds"):
            metric = CounterMetricFamily(f"radixserve_replica_kv_share_{attr}",
                                         f"--kv-share {attr.replace('_', ' ')}, per replica",
                                         labels=["replica"])
            for rid, s in stats.items():
                if s.share is not None:
                    metric.add_metric([rid], getattr(s.share, attr))
            yield metric

    def _router_metrics(self) -> Iterator[Metric]:
        st = self._state
        now = time.time()
        held = GaugeMetricFamily("radixserve_router_view_tokens",
                                 "Cached tokens the router knows each replica holds "
                                 "(its latest digest)", labels=["replica"])
        age = GaugeMetricFamily("radixserve_router_view_age_seconds",
                                "Age of the router's latest digest of each replica",
                                labels=["replica"])
        flight = GaugeMetricFamily("radixserve_router_in_flight_requests",
                                   "Requests the router sent to each replica, not yet done",
                                   labels=["replica"])
        with st.lock:
            for rid, r in sorted(st.replicas.items()):
                flight.add_metric([rid], r.in_flight)
                if r.digest is not None:
                    held.add_metric([rid], len(r.digest.hashes) * st.block_tokens)
                    age.add_metric([rid], max(0.0, now - r.digest.taken_at))
            decisions, seconds = st.decisions, st.decision_seconds
            sent = dict(st.sent)
        yield held
        yield age
        yield flight
        routed = CounterMetricFamily("radixserve_router_requests",
                                     "Requests the router dispatched to each replica",
                                     labels=["replica"])
        for rid, n in sorted(sent.items()):
            routed.add_metric([rid], n)
        yield routed
        yield CounterMetricFamily("radixserve_router_decisions", "Routing decisions made",
                                  value=decisions)
        yield CounterMetricFamily("radixserve_router_decision_seconds",
                                  "Time spent choosing replicas", value=seconds)
