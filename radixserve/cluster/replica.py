"""One engine replica: the Ray Serve deployment class (no Ray import: Ray wraps it).

Each replica loads the model and runs its own `Engine` on the replica actor's event loop.
Calls come from the front end through a DeploymentHandle: `generate` streams the engine's
`RequestOutput`s; `control` answers stats / flush / describe (and a tenant's namespace
stats and flush) for the one replica a call is pinned to; `record_routing_stats` (called
by Ray Serve every routing-stats period) returns the cache digest and engine stats the
router reads. All three run on the replica's event
loop, the thread that owns the tree, so the digest walk sees a consistent tree.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from radixserve.engine.config import EngineConfig
from radixserve.engine.grammar import GrammarSpec
from radixserve.engine.grammar_cache import compiler_for
from radixserve.engine.outputs import EngineStats, RequestOutput
from radixserve.engine.sampling_params import SamplingParams

from .cache_digest import CacheDigest, DigestMaker
from .route_info import RouteInfo


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front end needs from the model, asked of one replica at start-up."""

    replica_id: str
    tokenizer: Any
    model: str
    max_model_len: int
    page_size: int
    pool_tokens: int


@dataclass(frozen=True)
class ReplicaSnapshot:
    replica_id: str
    stats: EngineStats
    digest: CacheDigest


@dataclass(frozen=True)
class NamespaceReply:
    """One replica's answer for one namespace: its counters (`namespace_stats`) or the
    pages it freed (`flush_namespace`), with the replica's snapshot after it."""

    snapshot: ReplicaSnapshot
    value: Any


def per_replica_events(engine_config: EngineConfig) -> EngineConfig:
    """Each replica's own --kv-events endpoints: ports moved by its Ray Serve rank (a free
    port stays free), so replicas on one host do not collide."""
    if not engine_config.kv_events:
        return engine_config
    from ray import serve

    from radixserve.events.publisher import offset_endpoint_port

    try:
        rank = serve.get_replica_context().rank
        index = getattr(rank, "rank", rank) or 0
    except Exception:           # no replica context (tests outside Serve)
        index = 0
    moved = [e if e is None or e.endswith(":*") else offset_endpoint_port(e, index)
             for e in (engine_config.kv_events, engine_config.kv_events_replay)]
    return dataclasses.replace(engine_config, kv_events=moved[0], kv_events_replay=moved[1])


class EngineReplica:
    def __init__(self, engine_config: EngineConfig, block_tokens: int,
                 torch_threads: int | None = None, routing_stats_delay_s: float = 0.0):
        import torch

        from radixserve.engine.compute_thread import on_compute_thread
        from radixserve.engine.engine import Engine
        from radixserve.model import load_model

        if torch_threads:
            on_compute_thread(torch.set_num_threads, torch_threads)
        loaded = on_compute_thread(load_model, engine_config.model, dtype=engine_config.dtype,
                                   device=engine_config.device)
        engine_config = per_replica_events(engine_config)
        self.engine = Engine(engine_config, loaded)
        self.grammars = compiler_for(self.engine.tokenizer, engine_config)
        self.digests = DigestMaker(self.engine.tree, block_tokens)
        self.routing_stats_delay_s = routing_stats_delay_s     # tests: a slow replica
        self._start_lock: asyncio.Lock | None = None

    async def _ready(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            await self.engine.start()          # a no-op once started

    def _replica_id(self) -> str:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id

    async def generate(self, route: RouteInfo, prompt_ids: list[int], params: SamplingParams,
                       namespace: str | None, request_id: str,
                       grammar: GrammarSpec | None = None) -> AsyncIterator[RequestOutput]:
        """`grammar`: the request's constraint, sent as its spec (a compiled grammar does
        not cross processes) and compiled here: a memory or disk-cache hit, since the
        front end compiled it first, under the cap (and refused it with a 400 if it had
        to), so it is not capped again here."""
        await self._ready()
        if grammar is not None:
            params = dataclasses.replace(params, grammar=await self.grammars.compile(
                grammar, capped=False))
        stream = self.engine.generate(prompt_ids, params, namespace=namespace,
                                      request_id=request_id)
        async with aclosing(stream):
            async for out in stream:
                yield out

    async def control(self, route: RouteInfo, op: str, arg: Any = 0.0) -> Any:
        await self._ready()
        if op == "namespace_stats":            # arg: the namespace
            counts = await self.engine.namespace_stats(arg)
            return NamespaceReply(self.snapshot(), counts)
        if op == "flush_namespace":            # CacheBusy while one of its pages is locked
            freed = await self.engine.flush_namespace(arg)
            return NamespaceReply(self.snapshot(), freed)
        if op == "describe":
            e = self.engine
            return ReplicaInfo(self._replica_id(), e.tokenizer, e.config.model, e.max_model_len,
                               e.page_size, e.pool_tokens)
        if op == "flush":
            await self.engine.flush_cache()    # CacheBusy if anything is running
        elif op == "check":
            self.engine.check_invariants()
        elif op == "exit":                     # tests and benchmarks: a replica that dies
            os._exit(1)
        elif op == "pid":                      # tests: the worker process to kill -9
            return os.getpid()
        elif op == "stats_delay":              # tests: a replica slow to publish its stats
            self.routing_stats_delay_s = arg
        elif op == "streaming":                # tests: live requests that have sent tokens
            return sum(any(seq.num_generated >= 2 for seq in r.sequences)
                       for r in self.engine.scheduler.requests.values())
        elif op != "stats":
            raise ValueError(f"unknown control op {op!r}")
        return self.snapshot()

    def snapshot(self) -> ReplicaSnapshot:
        return ReplicaSnapshot(self._replica_id(), copy.deepcopy(self.engine.stats()),
                               self.digests.digest())

    async def record_routing_stats(self) -> dict[str, Any]:
        await self._ready()
        if self.routing_stats_delay_s:
            await asyncio.sleep(self.routing_stats_delay_s)
        snap = self.snapshot()
        out = {"digest": snap.digest, "stats": snap.stats}
        if self.engine.kv_events is not None:
            out["kv_event_metadata"] = self.kv_event_metadata()
        return out

    def kv_event_metadata(self) -> dict[str, Any]:
        """Where this replica's KV events are: the routing-stats entry Ray Serve LLM's
        KV-aware router reads (`kv_event_metadata`), plus topic and encoding."""
        import ray

        events = self.engine.kv_events
        host = ray.util.get_node_ip_address()

        def reachable(endpoint: str | None) -> str | None:
            if endpoint is None:
                return None
            return endpoint.replace("0.0.0.0", host).replace("*", host)

        return {"endpoint": reachable(events.publisher.endpoint),
                "replay_endpoint": reachable(events.publisher.replay_endpoint),
                "dp_rank": 0, "block_size": events.config.block_size,
                "max_num_batched_tokens": self.engine.config.chunked_prefill_size,
                "topic": events.config.topic, "encoding": events.config.encoding}
