"""RayEngineClient: the engine interface the HTTP front end uses, served by Ray replicas.

It is an `EngineClient` (server/engine_client.py), as a local `Engine` is, so the front
end code is unchanged:
`generate` streams from a replica through the DeploymentHandle (`.options(stream=True)`),
with the prompt's block hashes in a `RouteInfo` for the router.

Faults: a replica that dies before a request streamed anything is retried on another
replica (up to `max_retries` times); one that dies after gives the request a final output
with finish_reason "error" (the server renders it as an error event / error body), so
nothing hangs. Ray Serve restarts the replica; the router drops its view at once.

Stats: `stats()` (synchronous, as /metrics scrapes it) sums the latest snapshot of every
replica: from routing stats, refreshed by `refresh_stats()` (one control call per replica,
each bounded by a timeout so a slow replica cannot stall the endpoint). A tenant's
`namespace_stats` and `flush_namespace` fan out to every replica the same way and sum.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Callable, Sequence

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import RequestCancelledError

from radixserve.engine.errors import CacheBusy, NoDiskStore, PinConflict, UnknownPin, Unsupported
from radixserve.engine.outputs import EngineStats, RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.routing.routers import cache_key_hash

from .prefix_hashes import prompt_hashes
from .replica import NamespaceReply, ReplicaInfo, ReplicaSnapshot
from .route_info import RouteInfo
from .view import ClusterState

log = logging.getLogger("radixserve.cluster")

REPLICA_LOST = (RayActorError, ActorUnavailableError)
# Shared, not added up: the page size; the pin budget (the cluster pins nothing: 0).
NOT_SUMMED = frozenset({"page_size", "pinned_tokens_limit"})


def unwrap(exc: BaseException) -> BaseException:
    """The replica's own exception (QueueFull, InvalidRequest, CacheBusy...) out of Ray's."""
    if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), BaseException):
        return exc.cause
    return exc


@dataclass(frozen=True)
class ClientConfig:
    model: str
    max_model_len: int
    replicas: int


def sum_stats(snapshots: Sequence[EngineStats]) -> EngineStats:
    """One EngineStats for the cluster: counters and gauges summed, page size shared."""
    total = EngineStats()
    for s in snapshots:
        for f in fields(EngineStats):
            value = getattr(s, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and f.name not in NOT_SUMMED:
                setattr(total, f.name, getattr(total, f.name) + value)
        for reason, n in s.requests_finished.items():
            total.requests_finished[reason] = total.requests_finished.get(reason, 0) + n
        if s.cache is not None:
            total.cache = s.cache if total.cache is None else total.cache.merged(s.cache)
        if s.share is not None:                 # --kv-share
            total.share = s.share if total.share is None else total.share.merged(s.share)
        total.page_size = s.page_size
    return total


@dataclass(eq=False)
class RayEngineClient:
    handle: Any                              # DeploymentHandle of EngineReplica
    state: ClusterState                      # shared with the router (views_registry)
    num_replicas: int
    prompt_text_for_router: bool = False     # prefix-affinity reads prompt text
    max_retries: int = 2
    control_timeout_s: float = 10.0
    tokenizer: Any = None
    max_model_len: int = 0
    teardown: Callable[[], None] | None = None
    _live: dict[str, Any] = field(default_factory=dict)      # request id -> response stream
    _config: ClientConfig | None = None                      # set by `start`

    @property
    def config(self) -> ClientConfig:
        """The served model's facts, as the replicas describe them (after `start`)."""
        if self._config is None:
            raise RuntimeError("RayEngineClient.start() has not run")
        return self._config

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self, ready_timeout_s: float = 600.0) -> None:
        """Ask one replica for the model's facts; wait until the router sees every replica.
        (Once: the server calls it again after listening, as it does an Engine's.)"""
        if self._config is not None:
            return
        info: ReplicaInfo = await self.handle.control.remote(RouteInfo(), "describe")
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self._config = ClientConfig(info.model, info.max_model_len, self.num_replicas)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout_s
        while len(self.replica_ids()) < self.num_replicas:
            if loop.time() > deadline:
                raise TimeoutError(f"only {len(self.replica_ids())} of {self.num_replicas} "
                                   f"replicas became visible to the router")
            await asyncio.sleep(0.05)
        await self.refresh_stats()

    async def save_cache(self) -> dict:
        raise NoDiskStore("--kv-disk-dir is not supported with --replicas")

    async def shutdown(self, grace_s: float = 0.0, save_by: float | None = None) -> None:
        for response in list(self._live.values()):
            response.cancel()
        if self.teardown is not None:
            self.teardown()

    # ---- requests -------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 namespace: str | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        prompt_ids = list(prompt_ids)
        hashes = prompt_hashes(prompt_ids, self.state.block_tokens, namespace)
        text = ""
        if self.prompt_text_for_router:
            text = f"[{namespace}]" + self.tokenizer.decode(prompt_ids) if namespace \
                else self.tokenizer.decode(prompt_ids)
        route = RouteInfo(hashes, len(prompt_ids), prompt=text,
                          routing_key=cache_key_hash(params.cache_key))
        return self._stream(route, prompt_ids, params, namespace, request_id)

    async def _stream(self, route: RouteInfo, prompt_ids: list[int], params: SamplingParams,
                      namespace: str | None, request_id: str) -> AsyncIterator[RequestOutput]:
        unfinished = set(range(params.n))
        streamed = False
        attempt = 0
        grammar = params.grammar.spec if params.grammar is not None else None
        if grammar is not None:             # the replica compiles its own from the spec
            params = dataclasses.replace(params, grammar=None)
        while True:
            response = self.handle.options(stream=True).generate.remote(
                route, prompt_ids, params, namespace, request_id, grammar)
            self._live[request_id] = response
            try:
                async for out in response:
                    streamed = True
                    if out.finished:
                        unfinished.discard(out.index)
                    yield out
                return
            except REPLICA_LOST as exc:
                if not streamed and attempt < self.max_retries:
                    attempt += 1
                    log.warning("replica lost before request %s streamed: retry %d (%s)",
                                request_id, attempt, type(exc).__name__)
                    continue
                for out in self._ended(request_id, unfinished, "error",
                                       f"the replica serving this request failed: "
                                       f"{type(exc).__name__}"):
                    yield out
                return
            except RequestCancelledError:
                for out in self._ended(request_id, unfinished, "abort", None):
                    yield out
                return
            except RayTaskError as exc:
                raise unwrap(exc) from None
            finally:
                if self._live.get(request_id) is response:
                    del self._live[request_id]
                    if unfinished:
                        response.cancel()

    @staticmethod
    def _ended(request_id: str, indices: set[int], reason: str,
               error: str | None) -> list[RequestOutput]:
        import time
        now = time.monotonic()
        outs = [RequestOutput(request_id, i, [], "", finished=True, finish_reason=reason,
                              error=error, arrival_time=now, time=now) for i in sorted(indices)]
        indices.clear()
        return outs

    def abort(self, request_id: str) -> None:
        response = self._live.get(request_id)
        if response is not None:
            response.cancel()

    @property
    def ready(self) -> bool:
        return self._config is not None

    @property
    def error(self) -> str | None:
        return None                 # a dead replica is Ray Serve's to restart, not fatal

    async def flush_namespace(self, namespace: str | None) -> int:
        """Flush one namespace on every replica; the pages freed in all. A replica where a
        request holds one of its pages refuses (CacheBusy, 409) and keeps it; the others
        are flushed all the same (a tenant retries once its requests are done)."""
        replies = await self._namespace_call("flush_namespace", namespace)
        busy = [rid for rid, r in replies.items() if isinstance(r, CacheBusy)]
        if busy:
            raise CacheBusy(f"requests hold this namespace's pages on {len(busy)} of "
                            f"{len(replies)} replicas; those kept them")
        return sum(r.value for r in replies.values())

    async def namespace_stats(self, namespace: str | None) -> dict[str, int]:
        """One namespace's counters (`cached_tokens`, `nodes`), summed over the replicas."""
        total: dict[str, int] = {}
        for reply in (await self._namespace_call("namespace_stats", namespace)).values():
            for key, n in reply.value.items():
                total[key] = total.get(key, 0) + n
        return total

    async def _namespace_call(self, op: str, namespace: str | None
                              ) -> dict[str, NamespaceReply | CacheBusy]:
        """`op` for one namespace on every replica; each reply's snapshot refreshes the view.
        CacheBusy is returned per replica; any other failure is raised."""
        ids = self.replica_ids()
        results = await asyncio.gather(*(self.control(r, op, namespace) for r in ids),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, NamespaceReply):
                self._publish(res.snapshot)
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, CacheBusy):
                raise res
        return dict(zip(ids, results))

    # ---- pins: not across replicas (a pin would have to hold on every one) ------------

    async def pin(self, prompt_ids: Sequence[int], namespace: str | None = None):
        raise PinConflict("pinning prefixes is not supported with --replicas: serve without "
                          "--replicas to pin", code="pinning_unsupported")

    async def unpin(self, pin_id: str):
        raise UnknownPin(f"no pinned prefix has the id {pin_id[:100]!r} (pinning is not "
                         f"supported with --replicas)")

    def pinned(self) -> list:
        return []

    def cache_tree(self, limit: int, namespace: str | None = None, *, label_key: bytes,
                   reveal: Callable[[str | None], bool]) -> dict:
        raise Unsupported("the cache tree view is not supported with --replicas: each "
                          "replica has its own tree")

    def describe_kv_cache(self) -> None:
        """None: each replica prints its own KV cache line."""
        return None

    def describe_weights(self) -> None:
        """None: each replica holds its own weights."""
        return None

    # ---- control: stats and flush ------------------------------------------------------

    def replica_ids(self) -> list[str]:
        with self.state.lock:
            return sorted(self.state.replicas)

    async def control(self, replica_id: str, op: str, arg: Any = 0.0) -> Any:
        try:
            return await asyncio.wait_for(
                self.handle.control.remote(RouteInfo(target=replica_id), op, arg),
                self.control_timeout_s)
        except RayTaskError as exc:
            raise unwrap(exc) from None

    async def refresh_stats(self) -> dict[str, EngineStats]:
        """Fresh stats and digests from every replica (a replica that does not answer in
        time keeps its last published ones)."""
        ids = self.replica_ids()
        results = await asyncio.gather(*(self.control(r, "stats") for r in ids),
                                       return_exceptions=True)
        for rid, res in zip(ids, results):
            if isinstance(res, ReplicaSnapshot):
                self._publish(res)
            else:
                log.warning("replica %s did not report stats: %r", rid, res)
        return self.replica_stats()

    def _publish(self, snap: ReplicaSnapshot) -> None:
        with self.state.lock:
            if snap.replica_id in self.state.replicas:
                self.state.published(snap.replica_id, {"digest": snap.digest,
                                                       "stats": snap.stats})

    def replica_stats(self) -> dict[str, EngineStats]:
        with self.state.lock:
            return {rid: s.stats for rid, s in sorted(self.state.replicas.items())
                    if s.stats is not None}

    def stats(self) -> EngineStats:
        return sum_stats(list(self.replica_stats().values()))

    def metrics_collector(self):
        """Per-replica and router metrics for the server's registry."""
        from .metrics import ClusterCollector
        return ClusterCollector(self.replica_stats, self.state)

    async def flush_cache(self) -> None:
        """Flush every replica; CacheBusy (409) if any replica has work."""
        stats = await self.refresh_stats()
        busy = {rid: s.running + s.waiting for rid, s in stats.items() if s.running + s.waiting}
        if busy or self._live:
            raise CacheBusy(f"requests are running on replicas {busy or 'being routed'}")
        ids = self.replica_ids()
        results = await asyncio.gather(*(self.control(r, "flush") for r in ids),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, ReplicaSnapshot):
                self._publish(res)
        for res in results:
            if isinstance(res, BaseException):
                raise res
