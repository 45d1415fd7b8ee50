"""The aiohttp application: shared state, middlewares (errors, auth, draining), routes, and
starting / draining a server.

Errors are rendered in one place (the outermost middleware), so every failure — ours, the
engine's, aiohttp's own 404/405/413 — reaches the client as an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgspec
from aiohttp import web

from radixserve.server.auth import AuthConfig
from radixserve.server.errors import ApiError, api_error_from
from radixserve.server.metrics import ServerMetrics
from radixserve.server.openai_serving import ModelInfo, model_info

log = logging.getLogger("radixserve.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PUBLIC_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    auth: AuthConfig = field(default_factory=AuthConfig)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace_s: float = 30.0
    served_model_name: str | None = None
    retry_after_s: int = 1
    access_log: bool = False


@dataclass(eq=False)
class ServerState:
    """Everything a handler needs, reached through `request.app[STATE]`."""

    engine: Any
    config: ServerConfig
    info: ModelInfo
    metrics: ServerMetrics
    draining: bool = False
    active: set[str] = field(default_factory=set)     # request ids being served
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    @classmethod
    def create(cls, engine, config: ServerConfig) -> "ServerState":
        return cls(engine=engine, config=config,
                   info=model_info(engine, config.served_model_name),
                   metrics=ServerMetrics(engine.stats))

    @contextmanager
    def track(self) -> Iterator[str]:
        """A fresh request id, known to the server until the handler is done with it."""
        request_id = uuid.uuid4().hex
        self.active.add(request_id)
        self.idle.clear()
        try:
            yield request_id
        finally:
            self.active.discard(request_id)
            if not self.active:
                self.idle.set()


STATE = web.AppKey("radixserve_state", ServerState)
# request-scoped: the API key's namespace (web.RequestKey exists from aiohttp 3.12)
KEY_NAMESPACE = (web.RequestKey("radixserve_key_namespace", str) if hasattr(web, "RequestKey")
                 else "radixserve_key_namespace")


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers,
                        content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body(), status=err.status, headers=err.headers or None)


def _from_http_exception(exc: web.HTTPException, request: web.Request, state: ServerState) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no route for {request.method} {request.path}",
                        type="not_found_error", code="not_found")
    if exc.status == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.path}",
                        type="invalid_request_error", code="method_not_allowed")
    if exc.status == 413:
        return ApiError(413, f"request body is larger than the limit of "
                             f"{state.config.max_body_bytes} bytes",
                        type="invalid_request_error", code="body_too_large")
    return ApiError(exc.status, exc.reason or exc.text or "HTTP error", type="invalid_request_error")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = _from_http_exception(exc, request, state)
    except asyncio.CancelledError:
        raise
    except Exception as exc:     # noqa: BLE001 - every failure becomes an OpenAI error body
        err = api_error_from(exc)
        if err.status >= 500 and err.code == "internal_error":
            log.exception("unhandled error on %s %s", request.method, request.path)
    if err.status == 503 and err.code == "queue_full":
        err.headers["Retry-After"] = str(state.config.retry_after_s)
    return error_response(err)


@web.middleware
async def gate_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse new work while draining or starting; check the API key everywhere but /health."""
    state = request.app[STATE]
    if state.draining:
        raise ApiError(503, "the server is shutting down", type="service_unavailable",
                       code="shutting_down")
    if not state.engine.ready:               # listening, but the engine is still warming up
        raise ApiError(503, "the server is starting: the model is warming up",
                       type="service_unavailable", code="starting",
                       headers={"Retry-After": str(state.config.retry_after_s)})
    auth = state.config.auth
    if auth.enabled and request.path not in PUBLIC_PATHS:
        key = auth.check(request.headers.get("Authorization"))
        if key is None:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
        request[KEY_NAMESPACE] = auth.key_namespace(key)
    return await handler(request)


async def read_body(request: web.Request) -> bytes:
    """The request body (aiohttp raises 413 past client_max_size while reading)."""
    return await request.read()


def build_app(state: ServerState) -> web.Application:
    from radixserve.server import native_api, openai_api

    app = web.Application(client_max_size=state.config.max_body_bytes,
                          middlewares=[error_middleware, gate_middleware])
    app[STATE] = state
    openai_api.add_routes(app)
    native_api.add_routes(app)
    return app


async def start_server(state: ServerState, host: str, port: int) -> web.AppRunner:
    """Serve `state` on host:port (port 0: any free port; see `bound_address`)."""
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=logging.getLogger("aiohttp.access")
                           if state.config.access_log else None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def bound_address(runner: web.AppRunner) -> tuple[str, int]:
    host, port = runner.addresses[0][:2]
    return host, port


async def drain_and_stop(runner: web.AppRunner, state: ServerState, grace_s: float) -> None:
    """Stop accepting, let running requests finish within `grace_s`, abort the rest."""
    state.draining = True
    for site in list(runner.sites):
        await site.stop()
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=max(0.0, grace_s))
    except asyncio.TimeoutError:
        log.warning("grace period over: aborting %d running request(s)", len(state.active))
        for request_id in list(state.active):
            state.engine.abort(request_id)
        try:
            await asyncio.wait_for(state.idle.wait(), timeout=5.0)
        except asyncio.TimeoutError:
            log.error("%d request(s) did not end after abort", len(state.active))
    await runner.cleanup()
