"""Cluster simulation results: the sweep over replicas x routers, as a table and JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .cluster import ClusterStats, ServiceModel
from .replayer import ReplayStats
from .report import human_tokens


@dataclass(slots=True)
class ClusterReport:
    trace: str
    requests: int
    prompt_tokens: int
    mode: str
    page_size: int
    concurrency: int
    warmup_fraction: float
    service: ServiceModel
    seconds_per_time_unit: float
    cache_weight: float
    load_bound: str = ""                    # cache-aware router's LoadBound, as C+S
    points: list[ClusterStats] = field(default_factory=list)
    # One replica holding the cluster's total capacity: (total tokens, policy) -> stats.
    single: dict[tuple[int, str], ReplayStats] = field(default_factory=dict)

    def single_for(self, p: ClusterStats) -> ReplayStats:
        return self.single[p.replicas * p.capacity_tokens, p.policy]

    def of_single(self, p: ClusterStats) -> float | None:
        """The cluster's hit tokens over those of one replica with the total capacity."""
        ref = self.single_for(p)
        return p.hit_tokens / ref.hit_tokens if ref.hit_tokens else None

    def to_dict(self) -> dict:
        points = []
        for p in self.points:
            d = p.to_dict()
            ref = self.single_for(p)
            d["single_replica_token_hit_rate"] = ref.token_hit_rate
            d["fraction_of_single_replica"] = self.of_single(p)
            points.append(d)
        return {
            "trace": self.trace, "requests": self.requests,
            "prompt_tokens": self.prompt_tokens, "mode": self.mode,
            "page_size": self.page_size, "concurrency": self.concurrency,
            "warmup_fraction": self.warmup_fraction, "service": asdict(self.service),
            "seconds_per_time_unit": self.seconds_per_time_unit,
            "cache_weight": self.cache_weight, "load_bound": self.load_bound,
            "points": points,
            "single_replica": [s.to_dict() for s in self.single.values()],
        }


def format_cluster_table(report: ClusterReport) -> str:
    """One row per (capacity per replica, policy, replicas, router)."""
    svc = report.service
    head = (f"{'replicas':>8} {'router':>15} {'cap/repl':>9} {'policy':>6} "
            f"{'token hit':>9} {'of single':>9} {'prefill tokens':>15} {'load max/mean':>13} "
            f"{'req max/mean':>12} {'ttft p50':>8} {'ttft p99':>8} {'time s':>7}")
    lines = [f"trace {report.trace}: {report.requests:,d} requests, "
             f"{report.prompt_tokens:,d} prompt tokens, {report.mode} mode, page size "
             f"{report.page_size}; service model: prefill {svc.prefill_seconds_per_token:g} "
             f"s/token, decode {svc.decode_seconds_per_token:g} s/token, first come first "
             f"served per replica", head, "-" * len(head)]
    for p in report.points:
        of = report.of_single(p)
        lines.append(
            f"{p.replicas:8d} {p.router + ('+share' if p.share_tokens else ''):>15} "
            f"{human_tokens(p.capacity_tokens):>9} "
            f"{p.policy:>6} {p.token_hit_rate:9.2%} "
            f"{(f'{of:9.1%}' if of is not None else '-'):>9} {p.prefill_tokens:15,d} "
            f"{p.load_spread:13.2f} {p.request_spread:12.2f} {p.ttft_p50:8.2f} "
            f"{p.ttft_p99:8.2f} {p.seconds:7.2f}")
    lines.append("one replica with the total capacity (the 'of single' reference):")
    for (total, policy), s in report.single.items():
        lines.append(f"  {human_tokens(total):>9} {policy:>6}: token hit {s.token_hit_rate:.2%}, "
                     f"prefill tokens {s.prefill_tokens:,d}")
    lines.append("of single: the cluster's hit tokens / the single replica's; load: busy "
                 "seconds per replica, max / mean; ttft in seconds (queue wait + prefill)")
    shared = [p for p in report.points if p.share_tokens]
    if shared:
        lines.append("+share: a cluster store below the replicas (--share); its loads count "
                     "as hits: " + ", ".join(f"{p.replicas} x {p.router} loaded "
                                             f"{p.loaded_tokens:,d}" for p in shared))
    return "\n".join(lines)
