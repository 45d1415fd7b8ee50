"""The tier sweep: every (capacity, policy) point with the server's host and disk tiers
(cache/tiers.py, run by tiers.py) below it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .replayer import ReplayConfig
from .report import human_tokens
from .sweep import SweepOptions, prepare, progress_bar
from .tiers import TierConfig, TierReplayStats, simulate_tiers


@dataclass(slots=True)
class TierReport:
    trace: str
    requests: int
    mode: str
    page_size: int
    concurrency: int
    warmup_fraction: float
    tiers: TierConfig
    points: list[TierReplayStats] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"trace": self.trace, "requests": self.requests, "mode": self.mode,
                "page_size": self.page_size, "concurrency": self.concurrency,
                "warmup_fraction": self.warmup_fraction, "tiers": asdict(self.tiers),
                "points": [p.to_dict() for p in self.points]}


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f}"


def format_tier_table(report: TierReport) -> str:
    t = report.tiers
    head = (f"{'capacity':>9} {'policy':>6} {'gpu hit':>8} {'host hit':>8} {'disk hit':>8} "
            f"{'total':>7} {'prefill tokens':>15} {'host in GB':>10} {'host out GB':>11} "
            f"{'disk in GB':>10} {'disk out GB':>11} {'time s':>7}")
    lines = [f"trace {report.trace}: {report.requests:,d} requests, {report.mode} mode, "
             f"page size {report.page_size}; host {human_tokens(t.host_capacity_tokens or 0)}"
             f" tokens, disk {human_tokens(t.disk_capacity_tokens or 0)} tokens, "
             f"{t.kv_bytes_per_token:,d} KV bytes per token", head, "-" * len(head)]
    for p in report.points:
        lines.append(
            f"{human_tokens(p.capacity_tokens):>9} {p.policy:>6} {p.hit_rate('gpu'):8.2%} "
            f"{p.hit_rate('host'):8.2%} {p.hit_rate('disk'):8.2%} {p.hit_rate():7.2%} "
            f"{p.query_tokens - p.total_hit_tokens:15,d} {_gb(p.bytes_in['host']):>10} "
            f"{_gb(p.bytes_out['host']):>11} {_gb(p.bytes_in['disk']):>10} "
            f"{_gb(p.bytes_out['disk']):>11} {p.seconds:7.2f}")
    lines.append("capacity: the first tier (the KV pool); hit rates are shares of all prompt "
                 "tokens; the server's tiers (exclusive: a load takes a page out of its tier); "
                 "in = written into the tier (demotions), out = read from it (loads, "
                 "demotions to disk)")
    return "\n".join(lines)


def run_tier_sweep(opts: SweepOptions, tiers: TierConfig,
                   warn: Callable[[str], None] = lambda _: None) -> TierReport:
    if any(cap is None for cap in opts.capacities):
        raise ValueError("a tier simulation needs a finite --capacity-tokens (the first tier)")
    prep = prepare(opts, warn)
    workload = prep.workload
    grid = [(cap, pol) for cap in opts.capacities for pol in opts.policies]
    bar = progress_bar(opts.progress, len(grid) * len(workload), "tiers")
    report = TierReport(opts.trace, len(workload), prep.mode, prep.page_size,
                        opts.concurrency, opts.warmup_fraction, tiers)
    try:
        for cap, pol in grid:
            if bar is not None:
                bar.set_postfix_str(f"{pol} @ {cap}")
            config = ReplayConfig(cap, pol, opts.concurrency, opts.warmup_fraction,
                                  opts.check_every)
            report.points.append(simulate_tiers(workload, config, tiers,
                                                bar.update if bar is not None else None))
    finally:
        if bar is not None:
            bar.close()
    return report

