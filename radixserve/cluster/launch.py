"""Starting the replicas: Ray (local, or joined with an address), Ray Serve without its own
HTTP proxies (radixserve's front end is the only ingress), and the engine deployment with
the chosen router."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.engine.config import EngineConfig

from .affinity_router import affinity_router_class
from .client import RayEngineClient
from .prefix_hashes import routing_block_tokens
from .ray_router import POLICIES, RadixRequestRouter
from .replica import EngineReplica
from .view import ClusterState
from .views_registry import register

ROUTER_CHOICES = ("cache-aware", "prefix-affinity", "pow2", "round-robin")


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int
    router: str = "cache-aware"
    ray_address: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    routing_stats_period_s: float = 0.2
    routing_stats_timeout_s: float = 5.0
    prefill_seconds_per_token: float = 2e-4
    cache_weight: float = 4.0
    app_name: str = "radixserve"
    num_cpus: int | None = None            # a new local Ray only: CPUs it may use
    routing_stats_delay_s: float = 0.0     # tests: replicas slow to publish

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTER_CHOICES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_CHOICES)}")


def router_config(options: ClusterOptions, view_key: str, block_tokens: int
                  ) -> RequestRouterConfig:
    kwargs = {"view_key": view_key, "block_tokens": block_tokens}
    if options.router == "prefix-affinity":
        cls = affinity_router_class()
    else:
        cls = RadixRequestRouter
        assert options.router in POLICIES
        kwargs.update(policy=options.router,
                      prefill_seconds_per_token=options.prefill_seconds_per_token,
                      cache_weight=options.cache_weight)
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=options.routing_stats_period_s,
                               request_routing_stats_timeout_s=options.routing_stats_timeout_s)


def start_ray(options: ClusterOptions) -> None:
    if ray.is_initialized():
        return
    if options.ray_address:
        ray.init(address=options.ray_address, include_dashboard=False,
                 log_to_driver=False)
    else:
        ray.init(num_cpus=options.num_cpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    serve.start(proxy_location="Disabled")


def deploy(engine_config: EngineConfig, options: ClusterOptions) -> RayEngineClient:
    """Start (or join) Ray, run the replicas, and return the front end's client (not yet
    started: `await client.start()` on the serving event loop)."""
    start_ray(options)
    block_tokens = routing_block_tokens(engine_config.page_size)
    view_key = uuid.uuid4().hex
    state = ClusterState(block_tokens)
    register(view_key, state)
    deployment = serve.deployment(EngineReplica).options(
        name="EngineReplica",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus,
                           "num_gpus": options.replica_gpus},
        max_ongoing_requests=max(16, engine_config.max_queue_len),
        request_router_config=router_config(options, view_key, block_tokens),
        health_check_period_s=2.0,
    )
    threads = max(1, int(options.replica_cpus)) if options.replica_cpus else None
    app = deployment.bind(engine_config, block_tokens, threads, options.routing_stats_delay_s)
    handle = serve.run(app, name=options.app_name, route_prefix=None)
    return RayEngineClient(handle, state, options.replicas,
                           prompt_text_for_router=options.router == "prefix-affinity")


def teardown(options: ClusterOptions) -> None:
    serve.delete(options.app_name)
