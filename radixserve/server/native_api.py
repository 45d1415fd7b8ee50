"""Native routes: /generate (text or token ids in, ids + text + meta out), /health,
/cache/stats, /cache/flush, /metrics."""

from __future__ import annotations

import inspect
from contextlib import aclosing

from aiohttp import web

from radixserve.engine.outputs import RequestOutput
from radixserve.server import protocol as P
from radixserve.server.app import KEY_NAMESPACE, STATE, ServerState, json_response, read_body
from radixserve.server.auth import cache_namespace
from radixserve.server.errors import ApiError
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server import sse
from radixserve.server.openai_serving import (Prepared, Renderer, check_token_ids, engine_outputs,
                                              fit_context, validated_params)

DEFAULT_MAX_NEW_TOKENS = 128      # SGLang's default when the request names none


def prepare_generate(req: P.GenerateRequest, state: ServerState, key_namespace: str | None) -> Prepared:
    req.check()
    info = state.info
    if req.input_ids is not None:
        check_token_ids(req.input_ids, info.vocab_size, "input_ids")
        prompt_ids, param = list(req.input_ids), "input_ids"
    else:
        prompt_ids, param = list(state.engine.tokenizer.encode(req.text)), "text"
    requested = req.requested_max_tokens()
    if requested is None:
        room = fit_context(len(prompt_ids), None, info, param)
        max_tokens = min(DEFAULT_MAX_NEW_TOKENS, room)
    else:
        max_tokens = fit_context(len(prompt_ids), requested, info, param)
    params = validated_params(req.sampling_params.to_params(max_tokens), info)
    return Prepared(prompt_ids, params, cache_namespace(key_namespace, req.cache_salt))


class NativeResult:
    """Accumulates one /generate request's outputs."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[dict] = []
        self.final: RequestOutput | None = None

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


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = P.decode(await read_body(request), P.GenerateRequest)
    prepared = prepare_generate(req, state, request.get(KEY_NAMESPACE))
    observer = state.metrics.observer(1)
    with state.track() as request_id:
        result = NativeResult(request_id)
        outputs = engine_outputs(state.engine, prepared, observer, request_id)
        async with aclosing(outputs):
            if not req.stream:
                async for out in outputs:
                    result.add(out)
                if result.final is not None and (err := Renderer.failure(result.final)):
                    raise err
                return json_response(result.body(prepared.params.logprobs is not None))
            out = await anext(outputs, None)    # refusals raise here, before headers
            response = await sse.open_stream(request)
            try:
                while out is not None:
                    await response.write(sse.event(result.add(out)))
                    out = await anext(outputs, None)
                await response.write(sse.DONE)
            except ConnectionResetError:
                pass
            return response


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


def cache_stats_body(state: ServerState) -> dict:
    body = stats_body(state.engine.stats())
    per_replica = getattr(state.engine, "replica_stats", None)     # --replicas N
    if per_replica is not None:
        body["replicas"] = {rid: stats_body(s) for rid, s in per_replica().items()}
    return body


async def refresh_stats(state: ServerState) -> None:
    """Engines whose stats live elsewhere (Ray replicas) fetch them first."""
    refresh = getattr(state.engine, "refresh_stats", None)
    if refresh is not None:
        await refresh()


def stats_body(s) -> dict:
    tokens_total = s.pages_total * s.page_size
    return {
        "cache": dict(s.cache),
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
    }


async def cache_stats(request: web.Request) -> web.Response:
    await refresh_stats(request.app[STATE])
    return json_response(cache_stats_body(request.app[STATE]))


async def cache_flush(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await refresh_stats(state)
    s = state.engine.stats()            # a live object: copy what we compare
    running, waiting, cached_before = s.running, s.waiting, s.pages_cached
    if state.active or running or waiting:
        raise ApiError(409, f"cannot flush the cache while requests are running "
                            f"({running} running, {waiting} waiting)",
                       type="conflict_error", code="cache_busy")
    flushed = state.engine.flush_cache()    # CacheBusy -> 409 as well
    if inspect.isawaitable(flushed):        # Ray replicas: every one is flushed
        await flushed
    after = state.engine.stats()
    return json_response({"flushed": True, "freed_pages": cached_before - after.pages_cached,
                          "pages_free": after.pages_free})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/cache/stats", cache_stats)
    app.router.add_post("/cache/flush", cache_flush)
    app.router.add_get("/metrics", metrics)
