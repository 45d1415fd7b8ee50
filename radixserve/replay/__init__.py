"""Offline prefix hit-rate replay: request traces through the real RadixCache.

No model, no server, no torch: `radixserve replay TRACE` (cli.py) reads a trace
(traces.py), turns it into tree keys (workload.py, tokens.py), replays it on RadixCache +
PagedMemory (replayer.py) with the cache's policies or the Belady optimal (belady.py), and
reports (report.py, plot.py). See docs/replay.md.
"""
