"""The aiohttp application: middlewares (errors, gate), route wiring, and starting /
draining a server.

Errors are rendered in one place (the outermost middleware), so every failure — ours, the
engine's, aiohttp's own 404/405 — reaches the client as an OpenAI error body. The gate
refuses, before any handler runs: new work while draining, a missing or wrong key, a POST
whose body is not declared JSON (415) and a cross-origin POST from a browser page (403) —
the last two so that a web page cannot drive a server that has no key.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from radixserve.server import (anthropic_api, native_api, openai_api, openapi, pin_routes,
                               responses_api, ui_routes)
from radixserve.server.connections import LimitedSite
from radixserve.server.errors import ApiError, api_error_from
from radixserve.server.state import (CALLER, STATE, Caller, ServerConfig, ServerState,
                                     error_response)

__all__ = ["ServerConfig", "ServerState", "RunningServer", "build_app", "start_server",
           "bound_address", "drain_and_stop", "ROUTE_MODULES"]

log = logging.getLogger("radixserve.server")

PUBLIC_PATHS = frozenset({"/health", "/ui",    # /ui: the page shell, no data (ui_routes.py)
                          openapi.OPENAPI_PATH})
LINGER_S = 1.0
# Route modules, each with add_routes(app). Another module (e.g. a UI) appends itself here.
ROUTE_MODULES = [openai_api, native_api, pin_routes, ui_routes, responses_api, anthropic_api,
                 openapi]


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no route for {request.method} {request.path[:200]}",
                        type="not_found_error", code="not_found")
    if exc.status == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.path[:200]}",
                        type="invalid_request_error", code="method_not_allowed")
    return ApiError(exc.status, exc.reason or exc.text or "HTTP error", type="invalid_request_error")


def response_for(exc: Exception, request: web.Request) -> web.Response:
    """The OpenAI error response for any failure. Kept out of the middleware's frame: a
    caught exception stored in that frame would form a cycle (exception -> traceback ->
    frame -> exception) that keeps the request, and a refused 5 MB prompt's token ids,
    alive until a full garbage collection."""
    if isinstance(exc, web.HTTPException):
        err = _from_http_exception(exc, request)
    else:
        err = api_error_from(exc)
        if err.status >= 500 and err.code == "internal_error":
            log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    if err.status == 503 and err.code == "queue_full":
        err.headers["Retry-After"] = str(request.app[STATE].config.retry_after_s)
    response = error_response(err)
    if err.status in (408, 413):        # the rest of the body is not worth reading
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = response_for(exc, request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:     # noqa: BLE001 - every failure becomes an OpenAI error body
        response = response_for(exc, request)
    if response.status == 413:
        await close_unread(request, response)
    return response


async def close_unread(request: web.Request, response: web.Response) -> None:
    """Send a refusal, then close the connection without reading the rest of the body.
    aiohttp would otherwise read and drop it for up to LINGER_S (its "lingering close"):
    ~3 ms of the loop's CPU, holding the GIL, per 5 MB refused (measured for issue 39).
    A client that reads the reply while it sends (httpx, so the OpenAI SDK; curl) gets the
    413; one that writes the whole body first (http.client, requests) may see a reset."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass                            # the client left first: nothing to tell it
    request.protocol.force_close()      # flushes the reply, then closes: nothing more read


def check_origin(request: web.Request, allowed: tuple[str, ...]) -> None:
    """A browser sends `Origin` with every cross-site POST; non-browser clients send none.
    Same-origin pages (the server's own) and --allowed-origin pages may POST."""
    origin = request.headers.get("Origin")
    if origin is None or origin in allowed or origin == f"{request.scheme}://{request.host}":
        return
    raise ApiError(403, f"cross-origin request from {origin[:200]!r} refused; allow it with "
                        f"--allowed-origin", type="permission_error", code="origin_not_allowed")


def check_json_body(request: web.Request) -> None:
    if request.content_type != "application/json":
        raise ApiError(415, f"POST bodies must be JSON: send 'Content-Type: application/json' "
                            f"(got {request.headers.get('Content-Type', 'none')[:100]!r})",
                       type="invalid_request_error", code="unsupported_media_type")


def _bearer(anthropic_key: str | None) -> str | None:
    """Anthropic's clients send the key as `x-api-key`."""
    return None if anthropic_key is None else "Bearer " + anthropic_key


@web.middleware
async def gate_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse new work while draining or starting; check the API key, then a POST's origin
    and type."""
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
        key = auth.check(request.headers.get("Authorization")
                         or _bearer(request.headers.get("x-api-key")))
        if key is None:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")
        request[CALLER] = Caller(auth.key_namespace(key), auth.is_admin(key), auth.key_owner(key))
    if request.method == "POST":
        check_origin(request, state.config.allowed_origins)
        check_json_body(request)
    return await handler(request)


def build_app(state: ServerState) -> web.Application:
    # client_max_size applies to aiohttp's own readers; routes read through server/body.py
    app = web.Application(client_max_size=state.body_limit.bytes,
                          middlewares=[error_middleware, gate_middleware])
    app[STATE] = state
    for module in ROUTE_MODULES:
        module.add_routes(app)
    return app


@dataclass
class RunningServer:
    runner: web.AppRunner
    site: LimitedSite
    state: ServerState


async def start_server(state: ServerState, host: str, port: int) -> RunningServer:
    """Serve `state` on host:port (port 0: any free port; see `bound_address`)."""
    config = state.config
    # lingering: after answering a request whose body was not read (408, a 401 or 415 from
    # the gate), aiohttp reads and drops the rest for a while so the client gets the answer
    # instead of a reset; its default of 10 s would let a slow client hold the connection
    # that much longer. A 413 is closed at once instead (close_unread).
    runner = web.AppRunner(build_app(state), handler_cancellation=True, shutdown_timeout=0.5,
                           keepalive_timeout=config.header_timeout_s,
                           lingering_time=min(LINGER_S, config.header_timeout_s),
                           access_log=logging.getLogger("aiohttp.access")
                           if config.access_log else None)
    await runner.setup()
    site = LimitedSite(runner, host, port, config.max_connections, config.retry_after_s)
    await site.start()
    return RunningServer(runner, site, state)


def bound_address(server: RunningServer) -> tuple[str, int]:
    host, port = server.runner.addresses[0][:2]
    return host, port


async def drain_and_stop(server: RunningServer, grace_s: float) -> None:
    """Stop accepting, let running requests finish, abort the rest: all within `grace_s`,
    so an orchestrator whose kill timeout equals the grace never cuts a stream short of
    its abort event. The last quarter of the grace (at most 1 s) is kept for the aborts."""
    state = server.state
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, grace_s)
    state.draining = True
    await server.site.stop()
    abort_at = deadline - min(1.0, grace_s / 4)
    if not await _wait_idle(state, abort_at - loop.time()):
        log.warning("grace period over: aborting %d running request(s)", len(state.active))
        state.abort_all()
        if not await _wait_idle(state, deadline - loop.time()):
            log.error("%d request(s) did not end after abort", len(state.active))
    state.prompts.close()
    await server.runner.cleanup()


async def _wait_idle(state: ServerState, timeout: float) -> bool:
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=max(0.0, timeout))
        return True
    except asyncio.TimeoutError:
        return False
