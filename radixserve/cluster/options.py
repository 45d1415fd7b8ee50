"""`serve --replicas N` flags and the options they make (no Ray import: the flags must
parse, and fail clearly, where Ray is not installed)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from radixserve.routing import LoadBound, load_bound_arg

from . import RAY_EXTRA_HINT

ROUTER_CHOICES = ("cache-aware", "prefix-affinity", "pow2", "round-robin")
ROUTER_VIEWS = ("digest", "events")


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int
    router: str = "cache-aware"
    ray_address: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    routing_stats_period_s: float = 0.2
    routing_stats_timeout_s: float = 5.0
    prefill_seconds_per_token: float = 2e-4    # cache-aware score: see docs/scale-out.md
    decode_seconds_per_request: float = 0.1
    cache_weight: float = 4.0
    load_bound: LoadBound = LoadBound()    # cache-aware: requests in flight <= C x mean + S
    app_name: str = "radixserve"
    num_cpus: int | None = None            # a new local Ray only: CPUs it may use
    routing_stats_delay_s: float = 0.0     # tests: replicas slow to publish
    router_view: str = "digest"            # digest | events (cluster/event_feed.py)
    share_load_fraction: float | None = None   # --kv-share: a load's cost / a prefill's

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTER_CHOICES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_CHOICES)}")
        if self.router_view not in ROUTER_VIEWS:
            raise ValueError(f"--router-view must be one of {', '.join(ROUTER_VIEWS)}")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    d = ClusterOptions(replicas=1)
    g = parser.add_argument_group("replicas on Ray Serve (pip install 'radixserve[ray]')")
    g.add_argument("--replicas", type=int, default=0,
                   help="run N engine replicas as a Ray Serve deployment behind this server "
                        "(every engine flag applies to each replica; default: one engine "
                        "in this process)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto' or 'ray://head:10001') instead "
                        "of starting a local one")
    g.add_argument("--replica-cpus", type=float, default=d.replica_cpus,
                   help="CPUs per replica (also its torch threads)")
    g.add_argument("--replica-gpus", type=float, default=d.replica_gpus, help="GPUs per replica")
    g.add_argument("--router", default=d.router, choices=ROUTER_CHOICES,
                   help="how requests are spread over the replicas (docs/scale-out.md)")
    g.add_argument("--router-load-bound", type=load_bound_arg, default=d.load_bound,
                   metavar="C[+S]",
                   help="cache-aware router: a replica is a candidate while its requests in "
                        "flight stay within C x the mean + S; higher keeps prefixes on fewer "
                        "replicas, lower spreads load (default %(default)s; inf: no bound)")
    g.add_argument("--routing-stats-period-s", type=float, default=d.routing_stats_period_s,
                   help="how often each replica publishes its cache digest and load")
    g.add_argument("--router-view", default=d.router_view, choices=ROUTER_VIEWS,
                   help="how the router learns what each replica caches: digest (walked and "
                        "sent with the routing stats every period) or events (each replica's "
                        "KV events, on its own endpoint; docs/scale-out.md)")


def cluster_options(args: argparse.Namespace) -> ClusterOptions | None:
    """The options of `--replicas N`, or None for the single in-process engine."""
    if not getattr(args, "replicas", 0):
        return None
    return ClusterOptions(replicas=args.replicas, router=args.router,
                          ray_address=args.ray_address, replica_cpus=args.replica_cpus,
                          replica_gpus=args.replica_gpus,
                          routing_stats_period_s=args.routing_stats_period_s,
                          load_bound=args.router_load_bound,
                          router_view=getattr(args, "router_view", "digest"))


def import_launch():
    """radixserve.cluster.launch, or SystemExit with the one line that names the extra."""
    try:
        from . import launch
    except ImportError as exc:
        if (exc.name or "").split(".")[0] == "ray":
            raise SystemExit(f"radixserve: {RAY_EXTRA_HINT}") from None
        raise
    return launch
