"""Offline prefix hit-rate replay: request traces through the real RadixCache.

No model, no server, no torch: `radixserve replay TRACE` (cli.py) reads a trace
(traces.py), turns it into tree keys (workload.py, tokens.py), replays it on RadixCache +
PagedMemory (replayer.py) with the cache's policies or the Belady optimal (belady.py), and
reports (sweep.py, report.py, plot.py). With --replicas it simulates a cluster of such
caches behind a router from radixserve.routing (cluster.py, cluster_sweep.py,
cluster_report.py); with host and disk capacities, lower tiers below the cache (tiers.py,
tier_sweep.py). See docs/replay.md.
"""
