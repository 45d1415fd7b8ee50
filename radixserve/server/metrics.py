"""Prometheus metrics: counters and gauges read from `engine.stats()` at scrape time, latency
histograms observed from the outputs the server streams.

Reading counters from the engine at scrape time (a custom collector) keeps one source of
truth: the engine counts, the server only reports. Everything lives in a registry owned by
the app, so several servers (tests) never share state.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.engine.cache_stats import DiskStats
from radixserve.engine.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    """Counters and gauges straight from EngineStats, computed on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        counters = [
            ("radixserve_prefix_cache_queries_tokens",
             "Prompt tokens looked up in the prefix cache", s.prefix_query_tokens),
            ("radixserve_prefix_cache_hits_tokens",
             "Prompt tokens found in the prefix cache", s.prefix_hit_tokens),
            ("radixserve_prompt_tokens", "Prompt tokens of admitted requests", s.prompt_tokens),
            ("radixserve_generation_tokens", "Generated tokens", s.generation_tokens),
            ("radixserve_preemptions", "Sequences preempted for lack of KV pages", s.preemptions),
            ("radixserve_evicted_tokens", "Tokens evicted from the prefix cache", s.evicted_tokens),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("radixserve_requests", "Finished requests by finish reason",
                                       labels=["finish_reason"])
        for reason, count in sorted(s.requests_finished.items()):
            finished.add_metric([reason], count)
        yield finished
        yield GaugeMetricFamily("radixserve_pinned_tokens",
                                "Tokens of the pinned prefixes (POST /cache/pin), summed",
                                value=s.pinned_tokens)
        yield GaugeMetricFamily("radixserve_pinned_prefixes", "Pinned prefixes",
                                value=s.pinned_prefixes)
        yield GaugeMetricFamily("radixserve_running_requests", "Requests being computed",
                                value=s.running)
        yield GaugeMetricFamily("radixserve_waiting_requests", "Requests waiting for admission",
                                value=s.waiting)
        pages = GaugeMetricFamily("radixserve_kv_pages",
                                  "KV pages by state (cached includes locked)", labels=["state"])
        for state, value in (("free", s.pages_free), ("cached", s.pages_cached),
                             ("locked", s.pages_locked), ("private", s.pages_private)):
            pages.add_metric([state], value)
        yield pages
        if s.kv_disk is not None:                    # --kv-disk-dir
            yield CounterMetricFamily("radixserve_kv_disk_corrupt_pages",
                                      "KV pages on disk that failed their checksum (dropped, "
                                      "recomputed)", value=s.kv_disk.corrupt_pages)
            yield GaugeMetricFamily("radixserve_kv_disk_bytes", "Bytes of KV pages on disk",
                                    value=s.kv_disk.used_bytes)
            yield from disk_fault_metrics(s.kv_disk)
        if s.tiers is not None:                      # --kv-host-tokens / --kv-disk-dir
            yield from tier_metrics(s)
        if s.kv_events is not None:                  # --kv-events
            yield from kv_events_metrics(s.kv_events)
        if s.share is not None:                      # --kv-share
            yield from share_metrics(s.share)


def disk_fault_metrics(kv_disk: DiskStats) -> Iterator[Metric]:
    """Disk faults the KV disk store absorbed (storage/disk_faults.py), by kind."""
    faults = CounterMetricFamily("radixserve_kv_disk_faults",
                                 "Disk faults absorbed (the page dropped, recomputed)",
                                 labels=["kind"])
    for kind, count in kv_disk.faults.items():
        faults.add_metric([kind], count)
    yield faults
    yield CounterMetricFamily("radixserve_kv_disk_skipped_writes",
                              "Page writes not tried while writes were paused by a fault",
                              value=kv_disk.skipped_writes)
    yield GaugeMetricFamily("radixserve_kv_disk_writes_paused",
                            "1 while writes are paused after a disk fault",
                            value=int(kv_disk.writes_paused is not None))


def kv_events_metrics(e) -> Iterator[Metric]:
    """The KV events publisher (radixserve/events): batches sent, dropped, bytes, its CPU
    and its faults."""
    yield CounterMetricFamily("radixserve_kv_events_batches",
                              "KV event batches published", value=e.published_batches)
    yield CounterMetricFamily("radixserve_kv_events_dropped_batches",
                              "KV event batches dropped, oldest first, because the "
                              "publisher's queue was full", value=e.dropped_batches)
    yield CounterMetricFamily("radixserve_kv_events_bytes",
                              "Bytes of KV event payloads published", value=e.published_bytes)
    yield CounterMetricFamily("radixserve_kv_events_bad_replay_requests",
                              "Malformed replay requests ignored", value=e.bad_replay_requests)
    yield CounterMetricFamily("radixserve_kv_events_replay_requests",
                              "Replay requests received", value=e.replay_requests)
    yield CounterMetricFamily("radixserve_kv_events_publisher_cpu_seconds",
                              "CPU seconds the publisher spent (its process, or its thread "
                              "with --kv-events-publisher thread)", value=e.cpu_s)
    yield CounterMetricFamily("radixserve_kv_events_failed_batches",
                              "Batches whose events could not be computed (a snapshot "
                              "followed)", value=e.failed_batches)
    yield CounterMetricFamily("radixserve_kv_events_publisher_exits",
                              "Times the publisher process ended while the engine ran "
                              "(logged; restarted up to a bound)", value=e.publisher_exits)
    yield CounterMetricFamily("radixserve_kv_events_publisher_restarts",
                              "Times a publisher process that ended was restarted (its "
                              "first batch announces the whole cache)",
                              value=e.publisher_restarts)


def tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """Hits, loads, demotions and bytes moved by tier (docs/tiers.md)."""
    t = s.tiers
    lower = ("l2", "l3")
    hits = CounterMetricFamily("radixserve_kv_tier_hits_tokens",
                               "Prompt tokens served from the cache, by the tier they were in",
                               labels=["tier"])
    loaded = sum(t.tier(n).loaded_tokens for n in lower)
    hits.add_metric(["l1"], max(0, s.prefix_hit_tokens - loaded))
    for n in lower:
        hits.add_metric([n], t.tier(n).loaded_tokens)
    yield hits
    for key, doc in (("demoted_tokens", "Tokens written down into a tier"),
                     ("loaded_tokens", "Tokens loaded from a tier into the KV pool")):
        family = CounterMetricFamily(f"radixserve_kv_tier_{key}", doc, labels=["tier"])
        for n in lower:
            family.add_metric([n], getattr(t.tier(n), key))
        yield family
    moved = CounterMetricFamily("radixserve_kv_tier_bytes", "Bytes moved into and out of a tier",
                                labels=["tier", "direction"])
    for n in lower:
        moved.add_metric([n, "in"], t.tier(n).bytes_in)
        moved.add_metric([n, "out"], t.tier(n).bytes_out)
    yield moved
    yield CounterMetricFamily("radixserve_kv_tier_unreadable_pages",
                              "Disk-tier pages missing or failing their checksum (recomputed)",
                              value=t.corrupt_pages)
    held = GaugeMetricFamily("radixserve_kv_tier_tokens", "Tokens held and capacity by tier",
                             labels=["tier", "kind"])
    for n in lower:
        held.add_metric([n, "cached"], t.tier(n).cached_tokens)
        held.add_metric([n, "capacity"], t.tier(n).capacity_tokens)
    yield held


class ServerMetrics:
    """The app's registry: the engine collector plus latency histograms."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(stats))
        self.ttft = Histogram("radixserve_time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("radixserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a sample",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.misses = Counter("radixserve_prompt_cache_misses",
                              "Samples by where their prompt stopped matching the cache and why "
                              "(cache/miss_reasons.py; reason 'hit': nothing missing)",
                              ["reason", "tier"], registry=self.registry)
        self.missed_tokens = Counter("radixserve_prompt_cache_missed_tokens",
                                     "Prompt tokens computed (not served from the cache), by "
                                     "the reason the match stopped", ["reason"],
                                     registry=self.registry)
        self.e2e = Histogram("radixserve_e2e_request_latency_seconds",
                             "Arrival to the last sample's final output", buckets=_LATENCY_BUCKETS,
                             registry=self.registry)

    def observer(self, n: int = 1) -> "RequestTimer":
        return RequestTimer(self, n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's latencies from its outputs (time.monotonic stamps): TTFT at
    its first token, one inter-token gap per later token (an output carrying k tokens
    spreads its gap over them), end-to-end when the last of its n samples finishes."""

    def __init__(self, metrics: ServerMetrics, n: int = 1):
        self._m = metrics
        self._last: dict[int, float] = {}      # sample index -> time of its last token
        self._ttft_seen = False
        self._unfinished = n

    def on_output(self, out: RequestOutput) -> None:
        k = len(out.token_ids)
        if k:
            prev = self._last.get(out.index)
            if prev is None:
                first = out.first_token_time if out.first_token_time is not None else out.time
                if not self._ttft_seen:
                    self._ttft_seen = True
                    self._m.ttft.observe(max(0.0, first - out.arrival_time))
                prev, k = first, k - 1     # the first token has no predecessor
            if k > 0:
                gap = max(0.0, out.time - prev) / k
                for _ in range(k):
                    self._m.itl.observe(gap)
            self._last[out.index] = out.time
        if out.finished and out.usage is not None and out.usage.miss is not None:
            miss = out.usage.miss
            self._m.misses.labels(miss.reason.value, miss.tier or "").inc()
            self._m.missed_tokens.labels(miss.reason.value).inc(
                out.usage.prompt_tokens - out.usage.cached_tokens)
        if out.finished:
            self._unfinished -= 1
            if self._unfinished == 0 and out.finish_reason in ("stop", "length"):
                self._m.e2e.observe(max(0.0, out.time - out.arrival_time))


SHARE_COUNTERS = (
    ("loaded_tokens", "Prompt tokens loaded from the cluster store (computed by a peer)"),
    ("bytes_fetched", "Bytes of KV pages fetched from the cluster store"),
    ("bytes_published", "Bytes of KV pages published to the cluster store"),
    ("published_pages", "KV pages published to the cluster store"),
    ("duplicate_pages", "Publishes another replica had made already (one copy kept)"),
    ("forgotten_pages", "Cluster store entries found gone (evicted, owner died)"),
    ("refused_pages", "Pages from the cluster store refused: checksum or key mismatch "
                      "(recomputed, never served)"),
    ("skipped_slow", "Misses recomputed because the store was slower than computing"),
    ("load_seconds", "Seconds spent fetching pages from the cluster store"),
    ("claimed_pages", "Pages claimed in the cluster store before computing them"),
    ("waits", "Admissions that waited for a peer's claimed pages instead of computing"),
    ("wait_seconds", "Seconds admissions waited for peers' claimed pages"),
    ("waits_expired", "Waits for a peer's pages ended by the claim's expiry (then computed)"),
    ("lookups_late", "Store lookups unanswered within recompute's time (then computed)"),
)


def share_metrics(share) -> Iterator[Metric]:
    """--kv-share: what this server (a replicated one: all replicas) moved through the
    cluster store (engine/peer_share.py)."""
    for attr, doc in SHARE_COUNTERS:
        yield CounterMetricFamily(f"radixserve_kv_share_{attr}", doc, value=getattr(share, attr))
