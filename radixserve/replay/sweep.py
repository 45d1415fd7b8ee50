"""One replay run as the CLI sees it: read the trace, pick the mode, sweep the grid."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .replayer import ReplayConfig, replay
from .report import OPTIMAL, ReplayReport
from .tokens import TextTokenizer
from .traces import Trace, read_trace, tile_trace
from .workload import Workload


@dataclass(frozen=True, slots=True)
class SweepOptions:
    trace: str
    capacities: list[int | None]
    policies: list[str]
    format: str = "auto"
    block_size: int = 512
    mode: str = "auto"
    page_size: int | None = None
    optimal: bool = True
    concurrency: int = 1
    include_outputs: bool = False
    warmup_fraction: float = 0.0
    limit: int | None = None
    on_error: str = "stop"
    model: str = "smollm2-135m-instruct"
    progress: bool = False
    check_every: int = 0
    miss_reasons: bool = False
    tile: int = 1


def resolve_mode(fmt: str, mode: str, page_size: int, block_size: int | None) -> str:
    """auto: block mode for hash-id traces whose block size the page size divides."""
    if mode != "auto":
        return mode
    return "block" if fmt == "hash" and block_size % page_size == 0 else "token"


def check_policies(policies: list[str]) -> None:
    from radixserve.cache.eviction import POLICIES

    from .belady import OFFLINE_POLICIES

    known = set(POLICIES) | set(OFFLINE_POLICIES)
    for p in policies:
        if p not in known:
            raise ValueError(f"unknown policy {p!r}; choose from {sorted(known)}")
    if not policies:
        raise ValueError("no policy given")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A trace read, checked and turned into the workload every point of a sweep replays."""

    trace: Trace
    workload: Workload
    mode: str
    page_size: int


def prepare(opts: SweepOptions, warn: Callable[[str], None] = lambda _: None) -> Prepared:
    """Check the options, read (and tile) the trace, pick the mode and build the workload."""
    check_policies(opts.policies)
    if opts.page_size is not None and opts.page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {opts.page_size}")
    if opts.limit is not None and opts.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {opts.limit}")
    trace = read_trace(opts.trace, opts.format, opts.block_size, opts.on_error, opts.limit)
    trace = tile_trace(trace, opts.tile)
    for err in trace.skipped[:20]:
        warn(f"skipped {err}")
    if len(trace.skipped) > 20:
        warn(f"... and {len(trace.skipped) - 20} more malformed lines skipped")
    page_size = opts.page_size or (trace.block_size if trace.format == "hash" else 1)
    for cap in opts.capacities:
        if cap is not None and cap < page_size:
            raise ValueError(f"capacity {cap} tokens is less than one page ({page_size} "
                             "tokens): nothing could be cached")
    mode = resolve_mode(trace.format, opts.mode, page_size, trace.block_size)
    tokenizer = TextTokenizer(opts.model) if trace.format == "text" else None
    workload = Workload(trace, mode, page_size, opts.include_outputs, tokenizer)
    return Prepared(trace, workload, mode, page_size)


def progress_bar(enabled: bool, total: int, desc: str = "replay"):
    """A tqdm bar counting replayed requests, or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=desc, smoothing=0.1, leave=False)


def run_sweep(opts: SweepOptions, warn: Callable[[str], None] = lambda _: None
              ) -> ReplayReport:
    """Replay every (capacity, policy) point plus the unbounded ceiling."""
    prep = prepare(opts, warn)
    trace, workload, mode = prep.trace, prep.workload, prep.mode
    policies = list(opts.policies)
    if opts.optimal and OPTIMAL not in policies:
        if mode == "token" and trace.format == "text":
            warn("no Belady optimal for text traces in token mode (use --mode block)")
        else:
            policies.append(OPTIMAL)
    grid = [(cap, pol) for cap in opts.capacities if cap is not None for pol in policies]
    bar = progress_bar(opts.progress, (len(grid) + 1) * len(workload))

    def one(cap: int | None, policy: str):
        config = ReplayConfig(cap, policy, opts.concurrency, opts.warmup_fraction,
                              opts.check_every, opts.miss_reasons)
        if bar is not None:
            bar.set_postfix_str(f"{policy} @ {cap if cap is not None else 'inf'}")
        return replay(workload, config, bar.update if bar is not None else None)

    try:
        ceiling = one(None, "lru")
        points = [one(cap, pol) for cap, pol in grid]
    finally:
        if bar is not None:
            bar.close()
    return ReplayReport(
        trace=opts.trace, format=trace.format, mode=mode, page_size=prep.page_size,
        block_size=trace.block_size, requests=len(workload),
        skipped_lines=[str(e) for e in trace.skipped], concurrency=opts.concurrency,
        warmup_fraction=opts.warmup_fraction, include_outputs=opts.include_outputs,
        ceiling=ceiling, points=points)
