"""The cluster sweep: every (capacity, policy, replicas, router) point and its reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.routing import ROUTERS, LoadBound

from .cluster import ClusterConfig, ServiceModel, route_requests, simulate_cluster
from .cluster_report import ClusterReport
from .replayer import ReplayConfig, replay
from .belady import OFFLINE_POLICIES
from .sweep import SweepOptions, prepare, progress_bar


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    replicas: list[int]
    routers: list[str]
    service: ServiceModel = ServiceModel()
    seconds_per_time_unit: float = 1e-3
    cache_weight: float = 4.0
    seed: int = 0
    load_bound: LoadBound = LoadBound()
    # --share: each point also runs with a cluster store of this many tokens (0: as much as
    # all replicas hold together); None: no sharing.
    share_tokens: int | None = None
    share_load_fraction: float = 0.25


def parse_routers(text: str) -> list[str]:
    """'all' or a comma list of router names."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    if names == ["all"]:
        return list(ROUTERS)
    for r in names:
        if r not in ROUTERS:
            raise ValueError(f"unknown router {r!r}; choose from {', '.join(ROUTERS)} or all")
    if not names:
        raise ValueError("no router given")
    return list(dict.fromkeys(names))


def parse_replicas(text: str) -> list[int]:
    """A comma list of replica counts, each >= 1."""
    out = []
    for part in text.split(","):
        if part.strip():
            try:
                n = int(part)
            except ValueError:
                raise ValueError(f"bad replica count {part.strip()!r}") from None
            if n < 1:
                raise ValueError(f"--replicas must be >= 1, got {n}")
            out.append(n)
    if not out:
        raise ValueError("no replica count given")
    return list(dict.fromkeys(out))


def run_cluster_sweep(opts: SweepOptions, cluster: ClusterOptions,
                      warn: Callable[[str], None] = lambda _: None) -> ClusterReport:
    if any(cap is None for cap in opts.capacities):
        raise ValueError("a cluster simulation needs a finite --capacity-tokens per replica")
    policies = [p for p in opts.policies if p not in OFFLINE_POLICIES]
    if len(policies) < len(opts.policies):
        warn("the offline policies (belady, dead-first) are left out of the cluster "
             "simulation (each replica's future requests depend on the routing)")
    if not policies:
        raise ValueError("no online policy to simulate (the cluster cannot run belady)")
    prep = prepare(opts, warn)
    workload = prep.workload
    requests = route_requests(workload)
    shares = [None] if cluster.share_tokens is None else [None, cluster.share_tokens]
    grid = [(cap, pol, n, router, share) for cap in opts.capacities for pol in policies
            for n in cluster.replicas for router in cluster.routers for share in shares]
    singles = list(dict.fromkeys((n * cap, pol) for cap, pol, n, _, _ in grid))
    bar = progress_bar(opts.progress, (len(grid) + len(singles)) * len(workload), "cluster")
    update = bar.update if bar is not None else None
    report = ClusterReport(
        trace=opts.trace, requests=len(workload),
        prompt_tokens=sum(L for L, _ in workload.lengths()), mode=prep.mode,
        page_size=prep.page_size, concurrency=opts.concurrency,
        warmup_fraction=opts.warmup_fraction, service=cluster.service,
        seconds_per_time_unit=cluster.seconds_per_time_unit,
        cache_weight=cluster.cache_weight, load_bound=str(cluster.load_bound))
    try:
        for total, pol in singles:
            if bar is not None:
                bar.set_postfix_str(f"single replica, {pol} @ {total}")
            report.single[total, pol] = replay(
                workload, ReplayConfig(total, pol, opts.concurrency, opts.warmup_fraction,
                                       opts.check_every), update)
        for cap, pol, n, router, share in grid:
            if bar is not None:
                bar.set_postfix_str(f"{n} x {router}, {pol} @ {cap}")
            config = ClusterConfig(n, router, cap, pol, opts.concurrency,
                                   opts.warmup_fraction, cluster.service,
                                   cluster.seconds_per_time_unit, cluster.cache_weight,
                                   cluster.seed, opts.check_every, cluster.load_bound,
                                   share_tokens=0 if share is None else (share or n * cap),
                                   share_load_fraction=cluster.share_load_fraction)
            report.points.append(simulate_cluster(workload, config, requests, update))
    finally:
        if bar is not None:
            bar.close()
    return report
