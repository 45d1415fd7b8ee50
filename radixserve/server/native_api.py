"""Native routes: /generate (text or token ids in, ids + text + meta out), /health,
/cache/stats, /cache/flush, /metrics.

Cache routes are scoped to the caller: a tenant key sees and flushes only its own namespace
(and the salted ones under it); the whole cache needs an admin key (`--admin-api-key`), or
a server without keys.
"""

from __future__ import annotations


from typing import Any

from aiohttp import web

from radixserve.cache.summary import namespace_id
from radixserve.engine.outputs import RequestOutput
from radixserve.cache.namespaces import in_namespace
from radixserve.engine.pins import PinInfo
from radixserve.server import protocol as P
from radixserve.server.body import expect_continue, read_json
from radixserve.server.errors import ApiError
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server import native_schemas as NS
from radixserve.server.openapi import RouteDoc, documented
from radixserve.server.openai_serving import Renderer, run_on_engine
from radixserve.server.prompts import prepare_generate
from radixserve.server.sse import stream_events
from radixserve.server.state import STATE, Caller, ServerState, caller, json_response


class NativeResult:
    """Accumulates one /generate request's outputs."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[dict] = []
        self.final: RequestOutput | None = None
        self.stopped = False            # sse.EventSource: native streams never stop early

    def on_output(self, out: RequestOutput) -> list[Any]:
        return [self.add(out)]

    def closing(self) -> list[Any]:
        return []

    def abort_outputs(self) -> list[RequestOutput]:
        if self.final is not None:
            return []
        return [RequestOutput(self.request_id, 0, [], "", True, "abort", "aborted by the server")]

    def add(self, out: RequestOutput) -> dict:
        self.text.append(out.text)
        self.ids.extend(out.token_ids)
        delta_lp = [{"token_id": lp.token_id, "logprob": lp.logprob,
                     "top": [[t, v] for t, v in lp.top]} for lp in out.logprobs or []]
        self.logprobs.extend(delta_lp)
        if out.finished:
            self.final = out
        event = {"text": out.text, "output_ids": list(out.token_ids), "finished": out.finished}
        if delta_lp:
            event["logprobs"] = delta_lp
        if out.finished:
            event["meta_info"] = self.meta()
        return event

    def meta(self) -> dict:
        f = self.final
        usage = f.usage if f is not None else None
        first = f.first_token_time if f is not None else None
        meta = {
            "id": self.request_id,
            "finish_reason": f.finish_reason if f else None,
            "stop_reason": f.stop_reason if f else None,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else len(self.ids),
            "cached_tokens": usage.cached_tokens if usage else 0,
            "ttft_s": (first - f.arrival_time) if (f and first is not None) else None,
            "e2e_latency_s": (f.time - f.arrival_time) if f else None,
        }
        if f is not None and f.error:
            meta["error"] = f.error
        return meta

    def body(self, with_logprobs: bool) -> dict:
        body = {"text": "".join(self.text), "output_ids": self.ids, "meta_info": self.meta()}
        if with_logprobs:
            body["logprobs"] = self.logprobs
        return body


@documented(RouteDoc("Native generation: text or token ids in, ids, text and meta out",
                     body=P.GenerateRequest, response=NS.GenerateResponse,
                     stream=NS.GenerateEvent))
async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await read_json(request, P.GenerateRequest)
    prepared = await prepare_generate(req, state.prompts, caller(request).key_namespace)
    observer = state.metrics.observer(1)
    with state.track() as request_id:
        result = NativeResult(request_id)
        async with run_on_engine(state.engine, prepared, observer, request_id) as outputs:
            if req.stream:
                return await stream_events(request, outputs, result, state.config.sse_keepalive_s,
                                           state.stop_event(request_id))
            async for out in outputs:
                result.add(out)
        if result.final is not None and (err := Renderer.failure(result.final)):
            raise err
        return json_response(result.body(prepared.params.logprobs is not None))


@documented(RouteDoc("Liveness: 200 while the engine works, 503 once it failed",
                     response=NS.HealthResponse, public=True))
async def health(request: web.Request) -> web.Response:
    problem = request.app[STATE].engine.error
    if problem is not None:
        return json_response({"status": "unhealthy", "error": problem[:500]}, status=503)
    return json_response({"status": "ok"})


def cache_stats_body(state: ServerState) -> dict:
    """The whole cache's counters (admins; servers without keys)."""
    body = stats_body(state.engine.stats())
    body["pins"]["prefixes"] = pin_entries(state.engine.pinned())
    per_replica = state.engine.replica_stats()      # --replicas N
    if per_replica:
        body["replicas"] = {rid: stats_body(s) for rid, s in per_replica.items()}
    return body


def stats_body(s) -> dict:
    tokens_total = s.pages_total * s.page_size
    return {
        "cache": s.cache.as_dict() if s.cache is not None else {},
        "prefix_cache": {
            "query_tokens": s.prefix_query_tokens,
            "hit_tokens": s.prefix_hit_tokens,
            "hit_rate": (s.prefix_hit_tokens / s.prefix_query_tokens) if s.prefix_query_tokens else 0.0,
            "evicted_tokens": s.evicted_tokens,
        },
        "pool": {
            "page_size": s.page_size,
            "pages_total": s.pages_total,
            "pages_free": s.pages_free,
            "pages_cached": s.pages_cached,
            "pages_locked": s.pages_locked,
            "pages_private": s.pages_private,
            "tokens_total": tokens_total,
            "bytes_total": s.kv_pool_bytes,
            "usage": 1.0 - (s.pages_free / s.pages_total) if s.pages_total else 0.0,
        },
        "requests": {"running": s.running, "waiting": s.waiting, "preemptions": s.preemptions},
        "kv_disk": s.kv_disk.as_dict() if s.kv_disk is not None else None,
        "tiers": tier_body(s),
        "pins": {"pinned_tokens": s.pinned_tokens, "pinned_prefixes": s.pinned_prefixes,
                 "max_pinned_tokens": s.pinned_tokens_limit},
        "share": s.share.as_dict() if s.share is not None else None,     # --kv-share
    }


def tier_body(s) -> dict | None:
    """Hits by tier (l1: the KV pool) and each lower tier's use and movement."""
    if s.tiers is None:
        return None
    loaded = {n: s.tiers.tier(n).loaded_tokens for n in ("l2", "l3")}
    hits = {"l1": max(0, s.prefix_hit_tokens - sum(loaded.values())), **loaded}
    return {"hit_tokens": hits, **s.tiers.as_dict()}


def pin_entries(pins: list[PinInfo]) -> list[P.PinEntry]:
    """Pins as /cache/stats lists them: id, size, namespace; never their tokens."""
    return [P.PinEntry(p.pin_id, p.tokens, namespace_id(p.namespace)) for p in pins]


def visible_pins(who: Caller, pins: list[PinInfo]) -> list[PinInfo]:
    """The pins a caller may see and unpin: all for admins, its own namespace's for a tenant."""
    if who.admin:
        return pins
    scope = tenant_namespace(who, "Reading the pins of")
    return [p for p in pins if in_namespace(p.namespace, scope)]


def tenant_namespace(who: Caller, action: str) -> str | None:
    """The namespace a tenant key may act on; 403 when all keys share one namespace."""
    if who.key_namespace is None:
        raise ApiError(403, f"{action} the shared prefix cache needs an admin key "
                            f"(--admin-api-key); with --namespace-per-api-key each key acts "
                            f"on its own namespace", type="permission_error",
                       code="admin_key_required")
    return who.key_namespace


@documented(RouteDoc("Cache counters: the whole cache (admins) or the key's namespace",
                     response=NS.CacheStatsResponse, errors=(403,)))
async def cache_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    who = caller(request)
    if who.admin:
        await state.engine.refresh_stats()
        return json_response(cache_stats_body(state))
    counts = dict(await state.engine.namespace_stats(
        tenant_namespace(who, "Reading the stats of")))
    counts["pins"] = pin_entries(visible_pins(who, state.engine.pinned()))
    return json_response({"namespace": counts})


@documented(RouteDoc("Empty the prefix cache (admins) or the key's namespace",
                     response=NS.FlushResponse, errors=(409,)))
async def cache_flush(request: web.Request) -> web.Response:
    state = request.app[STATE]
    who = caller(request)
    if not who.admin:
        freed = await state.engine.flush_namespace(tenant_namespace(who, "Flushing"))  # 409
        return json_response({"flushed": True, "scope": "namespace", "freed_pages": freed,
                              "pages_free": state.engine.stats().pages_free})
    await state.engine.refresh_stats()
    s = state.engine.stats()            # a live object: copy what we compare
    running, waiting, cached_before = s.running, s.waiting, s.pages_cached
    if state.active or running or waiting:
        raise ApiError(409, f"cannot flush the cache while requests are running "
                            f"({running} running, {waiting} waiting)",
                       type="conflict_error", code="cache_busy")
    await state.engine.flush_cache()        # CacheBusy -> 409 as well
    after = state.engine.stats()
    return json_response({"flushed": True, "scope": "all",
                          "freed_pages": cached_before - after.pages_cached,
                          "pages_free": after.pages_free})


@documented(RouteDoc("Write the cache to --kv-disk-dir now (admins)",
                     response=NS.SaveResponse, errors=(409, 503, 507)))
async def cache_save(request: web.Request) -> web.Response:
    """Write the cache to --kv-disk-dir now (admins); 409 without a disk store."""
    state = request.app[STATE]
    if not caller(request).admin:
        raise ApiError(403, "saving the cache to disk needs an admin key (--admin-api-key)",
                       type="permission_error", code="admin_key_required")
    return json_response({"saved": True, **await state.engine.save_cache()})


@documented(RouteDoc("Prometheus metrics", media="text/plain"))
async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate, expect_handler=expect_continue)
    app.router.add_get("/health", health)
    app.router.add_get("/cache/stats", cache_stats)
    app.router.add_post("/cache/flush", cache_flush, expect_handler=expect_continue)
    app.router.add_post("/cache/save", cache_save, expect_handler=expect_continue)
    app.router.add_get("/metrics", metrics)
