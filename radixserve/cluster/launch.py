"""Starting the replicas: Ray (local, or joined with an address), Ray Serve without its own
HTTP proxies (radixserve's front end is the only ingress), and the engine deployment with
the chosen router."""

from __future__ import annotations

import dataclasses
import uuid

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.engine.config import EngineConfig

from .affinity_router import affinity_router_class
from .client import RayEngineClient
from .options import ClusterOptions
from .prefix_hashes import routing_block_tokens
from .ray_router import POLICIES, RadixRequestRouter
from .replica import EngineReplica
from .view import ClusterState
from .views_registry import register, unregister


# --kv-share: the router's estimate of a load's cost per token as a fraction of a prefill's
# (the replicas load only while it is below 1: engine/tier_costs.py). docs/scale-out.md.
SHARE_LOAD_FRACTION = 0.25


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
                      decode_seconds_per_request=options.decode_seconds_per_request,
                      cache_weight=options.cache_weight,
                      load_bound=str(options.load_bound),   # kwargs: plain values
                      load_fraction=options.share_load_fraction)
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=options.routing_stats_period_s,
                               request_routing_stats_timeout_s=options.routing_stats_timeout_s)


def events_config(engine_config: EngineConfig, block_tokens: int) -> EngineConfig:
    """--router-view events: every replica publishes its events in the router's blocks,
    on its own port (a free one unless --kv-events names a base port: then replica r
    takes base + r, as vLLM does per data-parallel rank)."""
    if engine_config.kv_events_block_size != block_tokens and engine_config.kv_events:
        raise SystemExit(f"radixserve: --router-view events needs --kv-events-block-size "
                         f"{block_tokens} (the router's block size)")
    return dataclasses.replace(engine_config,
                               kv_events=engine_config.kv_events or "tcp://*:*",
                               kv_events_replay=engine_config.kv_events_replay or "tcp://*:*",
                               kv_events_block_size=block_tokens)


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
    if engine_config.kv_share != "off" and options.share_load_fraction is None:
        options = dataclasses.replace(options, share_load_fraction=SHARE_LOAD_FRACTION)
    block_tokens = routing_block_tokens(engine_config.page_size)
    view_key = uuid.uuid4().hex
    state = ClusterState(block_tokens)
    if options.router_view == "events":
        from .event_feed import EventFeed

        state.event_source = EventFeed(state)
        engine_config = events_config(engine_config, block_tokens)
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
                           prompt_text_for_router=options.router == "prefix-affinity",
                           teardown=lambda: teardown(options, view_key))


async def start_client(engine_config: EngineConfig, options: ClusterOptions) -> RayEngineClient:
    """Deploy (blocking: start-up, before the server listens) and start the client."""
    client = deploy(engine_config, options)
    await client.start()
    return client


def teardown(options: ClusterOptions, view_key: str) -> None:
    """Remove the replicas (a joined cluster keeps running; a local Ray ends with us)."""
    state = unregister(view_key)
    if state is not None and state.event_source is not None:
        state.event_source.close()
    serve.delete(options.app_name)
