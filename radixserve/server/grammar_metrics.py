"""Constrained decoding in /metrics: grammar compile time, cache hits and misses (the
server's GrammarCompiler), and the time masks take per step (the engine's sampler)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.engine.grammar_cache import GrammarStats
from radixserve.engine.outputs import EngineStats


class GrammarCollector(Collector):
    def __init__(self, grammars: GrammarStats, engine_stats: Callable[[], EngineStats]):
        self._grammars = grammars
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        g = self._grammars
        yield CounterMetricFamily("radixserve_grammar_compiles",
                                  "Grammars built (validated, or read from disk, then built)",
                                  value=g.compiles)
        yield CounterMetricFamily("radixserve_grammar_compile_seconds",
                                  "Time spent compiling grammars", value=g.compile_seconds)
        hits = CounterMetricFamily("radixserve_grammar_cache_hits",
                                   "Grammar cache hits by tier", labels=["tier"])
        hits.add_metric(["memory"], g.memory_hits)
        hits.add_metric(["disk"], g.disk_hits)
        yield hits
        yield CounterMetricFamily("radixserve_grammar_cache_misses",
                                  "Grammars compiled from their source", value=g.misses)
        yield CounterMetricFamily("radixserve_grammar_refused",
                                  "Grammars refused (unsupported or malformed)", value=g.refused)
        yield CounterMetricFamily("radixserve_grammar_compile_timeouts",
                                  "Grammars past the compile cap (400)", value=g.timeouts)
        yield CounterMetricFamily("radixserve_grammar_prewarmed",
                                  "Grammars rebuilt at start from the disk cache",
                                  value=g.prewarmed)
        yield CounterMetricFamily("radixserve_grammar_prewarm_seconds",
                                  "Time spent rebuilding grammars at start", value=g.prewarm_seconds)
        masks = self._engine_stats().grammar_masks
        yield CounterMetricFamily("radixserve_grammar_mask_seconds",
                                  "Time spent computing and applying grammar masks",
                                  value=masks.seconds)
        yield CounterMetricFamily("radixserve_grammar_mask_steps",
                                  "Steps with at least one constrained row",
                                  value=masks.steps)
        yield CounterMetricFamily("radixserve_grammar_masked_rows",
                                  "Constrained rows masked, all steps", value=masks.rows)
