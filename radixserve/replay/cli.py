"""`radixserve replay TRACE`: what hit rate would a prefix cache of a given size reach?

Replays a request trace through the real RadixCache and reports, per capacity and eviction
policy, the token and request hit rates, the prefill tokens saved, the offline optimal
(Belady) and the ceiling (an unbounded cache). With --replicas it simulates a cluster of
caches behind a router; with --host-capacity-tokens / --disk-capacity-tokens a cache with
lower tiers. See docs/replay.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from radixserve.routing import LoadBound, load_bound_arg
from radixserve.units import parse_bytes, parse_tokens

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="JSONL trace: hash-id records (Mooncake style) or "
                        "text records with prompt / messages / input_ids")
    parser.add_argument("--format", choices=("auto", "hash", "text"), default="auto",
                        help="trace format (default: guessed from the first line)")
    parser.add_argument("--block-size", type=int, default=512,
                        help="tokens per hash id in hash-id traces (default 512)")
    parser.add_argument("--mode", choices=("auto", "token", "block"), default="auto",
                        help="token: real token ids in the tree; block: one symbol per page, "
                        "same hits, much faster (auto: block for hash-id traces when the "
                        "page size divides the block size, else token)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="tokens per KV page (default: the block size for hash-id "
                        "traces, 1 for text traces)")
    parser.add_argument("--capacity-tokens", default="inf",
                        help="cache capacity in tokens, or a comma list for a sweep; "
                        "suffixes k, M, G (and Ki, Mi, Gi); 'inf' for unbounded")
    parser.add_argument("--policy", default="lru",
                        help="comma list of eviction policies: lru, lfu, gdsf, adaptive, "
                        "and the offline bounds belady (the optimal) and dead-first (LRU "
                        "that evicts pages never used again first) (default lru; the Belady "
                        "optimal is added unless --no-optimal)")
    parser.add_argument("--no-optimal", action="store_true",
                        help="skip the offline-optimal (Belady) replay of each capacity")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight holding their prefix locked (default 1)")
    parser.add_argument("--include-outputs", action="store_true",
                        help="cache each request's output too (it takes pages)")
    parser.add_argument("--warmup-fraction", type=float, default=0.0,
                        help="leading share of requests left out of the reported rates")
    parser.add_argument("--limit", type=int, default=None,
                        help="replay only the first N requests of the file")
    parser.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                        help="on a malformed line: stop with its line number, or skip it")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="tokenizer for text traces (a short name, HF dir or .gguf)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="draw the report to this file (.png, .svg, .pdf, ...): hit rate "
                        "against capacity per policy; against replicas per router with "
                        "--replicas; stacked by tier with tier capacities")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--check-every", type=int, default=0, metavar="N",
                        help="debug: check tree invariants and page conservation every "
                        "N requests")
    parser.add_argument("--miss-reasons", action="store_true",
                        help="count each request's miss reason (hit, diverged, evicted, "
                             "never_seen...: docs/conversations.md), as the server reports it")
    parser.add_argument("--tile", type=int, default=1, metavar="N",
                        help="replay the trace N times over, one copy after another, each "
                        "with its own hash ids (a bigger trace of the same kind)")
    cluster = parser.add_argument_group(
        "cluster simulation", "N replicas, each with its own cache of --capacity-tokens, fed "
        "by a router at the trace's timestamps")
    cluster.add_argument("--replicas", default=None, metavar="N[,N...]",
                         help="replica counts to simulate, e.g. 1,4,16,64,256")
    cluster.add_argument("--router", default="all",
                         help="comma list of: cache-aware, prefix-affinity, pow2, "
                         "round-robin, consistent-hash; or all (default)")
    cluster.add_argument("--prefill-seconds-per-token", type=float, default=5e-5,
                         metavar="SECONDS",
                         help="service model: seconds per computed prompt token "
                         "(default 5e-5: 20k tokens/s; measure with scripts/bench_model.py)")
    cluster.add_argument("--decode-seconds-per-token", type=float, default=1e-3,
                         metavar="SECONDS",
                         help="service model: seconds per output token (default 1e-3)")
    cluster.add_argument("--time-unit", choices=("ms", "s"), default="ms",
                         help="unit of the trace's timestamps (default ms, as Mooncake)")
    cluster.add_argument("--cache-weight", type=float, default=4.0, metavar="W",
                         help="cache-aware router: weight of the prefill a cached prefix "
                         "saves against queued seconds (default 4; 1 = least estimated TTFT)")
    cluster.add_argument("--load-bound", type=load_bound_arg, default=LoadBound(),
                         metavar="C[+S]",
                         help="cache-aware router: only replicas that stay within C x the "
                         "mean requests in flight + S are candidates (default %(default)s; "
                         "inf: no bound)")
    cluster.add_argument("--seed", type=int, default=0, help="seed of the random routers")
    cluster.add_argument("--share", nargs="?", const=0, default=None, type=parse_tokens,
                         metavar="TOKENS",
                         help="also simulate every point with a cluster store (--kv-share): "
                              "a replica loads the part of a prompt the store holds instead "
                              "of computing it; TOKENS bounds the store (default: as much as "
                              "all replicas hold)")
    cluster.add_argument("--share-load-fraction", type=float, default=0.25, metavar="F",
                         help="a loaded token's time as a fraction of a computed one's "
                              "(service model and cache-aware score; default %(default)s)")
    parser.add_argument("--model-layout", default=None, metavar="MODEL",
                        help="a hybrid model's layer layout (a short name, model directory, "
                        ".gguf or config.json, as `radixserve plan` takes it): replay the "
                        "window-aware tree against a full-KV tree at the same bytes, and "
                        "report hit rates and bytes per layer group")
    tiers = parser.add_argument_group(
        "tier simulation", "host memory and disk below the cache, run by the server's tier "
        "code: evicted pages are demoted, a hit there is loaded instead of recomputed")
    tiers.add_argument("--host-capacity-tokens", default=None, metavar="TOKENS",
                       help="host-memory tier size (suffixes as --capacity-tokens)")
    tiers.add_argument("--disk-capacity-tokens", default=None, metavar="TOKENS",
                       help="disk tier size (suffixes as --capacity-tokens)")
    tiers.add_argument("--kv-bytes-per-token", type=parse_bytes, default=131072, metavar="BYTES",
                       help="KV bytes per token, for the bytes moved (default 131072: "
                       "Llama-3-8B in fp16)")


def run(args: argparse.Namespace) -> int:
    from .report import parse_capacities
    from .sweep import SweepOptions
    from .traces import TraceError

    try:
        if args.plot:
            from .plot import check_plot_path

            check_plot_path(args.plot)
        capacities = parse_capacities(args.capacity_tokens)
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        options = SweepOptions(
            trace=args.trace, format=args.format, block_size=args.block_size,
            mode=args.mode, page_size=args.page_size, capacities=capacities,
            policies=policies, optimal=not args.no_optimal, concurrency=args.concurrency,
            include_outputs=args.include_outputs, warmup_fraction=args.warmup_fraction,
            limit=args.limit, on_error=args.on_error, model=args.model,
            progress=not args.no_progress and not args.json, check_every=args.check_every,
            miss_reasons=args.miss_reasons,
            tile=args.tile)
        report, table, plot = _simulate(args, options)
    except (TraceError, ValueError, OSError) as exc:
        return _fail(exc)
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(table(report))
    if args.plot:     # after the report: a plot that fails loses nothing
        try:
            plot(report, args.plot)
        except (OSError, ValueError) as exc:
            return _fail(f"the report is above, but the plot failed: {exc}")
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _simulate(args: argparse.Namespace, options):
    """Run what the flags ask for: (report, its table function, its plot function)."""
    warn = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.replicas is not None:
        if args.host_capacity_tokens is not None or args.disk_capacity_tokens is not None:
            raise ValueError("simulate either a cluster (--replicas) or tiers "
                             "(--host/--disk-capacity-tokens), not both at once")
        from . import plot
        from .cluster import ServiceModel
        from .cluster_report import format_cluster_table
        from .cluster_sweep import (ClusterOptions, parse_replicas, parse_routers,
                                    run_cluster_sweep)

        cluster = ClusterOptions(
            replicas=parse_replicas(args.replicas), routers=parse_routers(args.router),
            service=ServiceModel(args.prefill_seconds_per_token,
                                 args.decode_seconds_per_token),
            seconds_per_time_unit=1e-3 if args.time_unit == "ms" else 1.0,
            cache_weight=args.cache_weight, seed=args.seed,
            load_bound=args.load_bound, share_tokens=args.share,
            share_load_fraction=args.share_load_fraction)
        return (run_cluster_sweep(options, cluster, warn), format_cluster_table,
                lambda r, path: plot.plot_cluster(r, path))
    if args.model_layout is not None:
        if args.host_capacity_tokens is not None or args.disk_capacity_tokens is not None:
            raise ValueError("--model-layout runs the pool alone: no --host/--disk tiers")
        from .layouts import format_layout_table, read_layout, run_layout_sweep

        def no_plot(report, path):
            raise ValueError("--plot is not drawn for --model-layout")
        return (run_layout_sweep(options, read_layout(args.model_layout), warn),
                format_layout_table, no_plot)
    if args.host_capacity_tokens is not None or args.disk_capacity_tokens is not None:
        from . import plot
        from .report import parse_capacity
        from .tier_sweep import format_tier_table, run_tier_sweep
        from .tiers import TierConfig

        sizes = [parse_capacity(v) if v is not None else 0
                 for v in (args.host_capacity_tokens, args.disk_capacity_tokens)]
        if None in sizes:
            raise ValueError("tier capacities must be finite")
        tiers = TierConfig(sizes[0], sizes[1], args.kv_bytes_per_token)
        return (run_tier_sweep(options, tiers, warn), format_tier_table,
                lambda r, path: plot.plot_tiers(r, path))
    from . import plot
    from .report import format_table
    from .sweep import run_sweep

    return run_sweep(options, warn), format_table, lambda r, path: plot.plot_curve(r, path)


def _fail(reason) -> int:
    print(f"radixserve replay: error: {reason}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixserve replay", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
