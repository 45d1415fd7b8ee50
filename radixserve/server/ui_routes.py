"""The live cache view: `GET /ui` (one page), `GET /cache/tree` (the bounded tree) and
`GET /cache/events` (server-sent counter snapshots).

The page is static: HTML, CSS and JS from `radixserve/server/ui/` (with the vendored
d3-hierarchy and uPlot) inlined into one document, so the shell is a single public path
that holds no data; every data route needs the API key like any other. The inline scripts
are allowed by hash in a Content-Security-Policy, nothing else runs.

Privacy: token text appears only with `--ui-show-text` and only for the caller's own
namespace (the API key's, refined by `cache_salt`); everything else is named by an HMAC
under a key drawn at start, so names are stable while the server runs and unguessable.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import html
import math
import secrets
import time
from dataclasses import dataclass, field
from importlib import resources

from aiohttp import web

from radixserve.cache.summary import MAX_TREE_LIMIT, namespace_id
from radixserve.server import sse
from radixserve.server.auth import cache_namespace
from radixserve.server.errors import bad_request
from radixserve.server.native_api import cache_stats_body
from radixserve.server.native_schemas import CacheTreeResponse
from radixserve.server.openapi import QueryParam, RouteDoc, documented
from radixserve.server.state import STATE, ServerState, caller, json_response

UI_PATH = "/ui"
DEFAULT_TREE_LIMIT = 200
DEFAULT_EVENTS_INTERVAL_S = 1.0
MIN_EVENTS_INTERVAL_S = 0.1
MAX_EVENTS_INTERVAL_S = 60.0
STYLES = ("vendor/uPlot.min.css", "app.css")
SCRIPTS = ("vendor/d3-hierarchy.min.js", "vendor/uPlot.iife.min.js", "app.js")


@dataclass(eq=False)
class UiState:
    """Per app: the key naming prefixes, the rendered page, and a signal ending SSE streams."""

    label_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    page: bytes | None = None
    page_headers: dict[str, str] = field(default_factory=dict)
    closing: asyncio.Event = field(default_factory=asyncio.Event)


UI = web.AppKey("radixserve_ui", UiState)


# ---------------------------------------------------------------------- the page
def _asset(name: str) -> str:
    return resources.files("radixserve.server").joinpath("ui", name).read_text("utf-8")


def render_page(state: ServerState) -> tuple[bytes, dict[str, str]]:
    """The page with its styles and scripts inlined, and the headers that allow exactly them."""
    scripts = [_asset(name) for name in SCRIPTS]
    for name, text in zip(SCRIPTS, scripts):
        if "</script" in text.lower():
            raise ValueError(f"{name} contains '</script' and cannot be inlined")
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()
                      + "'" for s in scripts)
    page = (_asset("index.html")
            .replace("{{auth}}", "required" if state.config.auth.enabled else "none")
            .replace("{{model}}", html.escape(state.info.name, quote=True))
            .replace("{{styles}}", "\n".join(f"<style>{_asset(n)}</style>" for n in STYLES))
            .replace("{{scripts}}", "\n".join(f"<script>{s}</script>" for s in scripts)))
    headers = {
        "Content-Security-Policy": (f"default-src 'none'; script-src {hashes}; "
                                    "style-src 'unsafe-inline'; connect-src 'self'; "
                                    "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                    "frame-ancestors 'none'"),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return page.encode(), headers


@documented(RouteDoc("The live cache view (an HTML page, no data)", media="text/html",
                     public=True))
async def ui_page(request: web.Request) -> web.Response:
    ui = request.app[UI]
    if ui.page is None:
        ui.page, ui.page_headers = render_page(request.app[STATE])
    response = web.Response(body=ui.page, headers=ui.page_headers,
                            content_type="text/html", charset="utf-8")
    response.enable_compression()
    return response


# ---------------------------------------------------------------------- GET /cache/tree
def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(name, f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise bad_request(name, f"{name} must be between {low} and {high}, got {value}")
    return value


def caller_namespace(request: web.Request) -> str | None:
    """The engine namespace the caller's own requests land in (key, refined by cache_salt)."""
    return cache_namespace(caller(request).key_namespace, request.query.get("cache_salt") or None)


def _add_text(state: ServerState, entries: list[dict]) -> None:
    decode = state.engine.tokenizer.decode
    for entry in entries:
        entry["text"] = decode(entry["token_ids"], skip_special_tokens=False)


@documented(RouteDoc(
    "The bounded prefix tree: the biggest namespaces and nodes", response=CacheTreeResponse,
    errors=(400,), query=(
        QueryParam("limit", {"type": "integer", "minimum": 1, "maximum": MAX_TREE_LIMIT},
                   "at most this many nodes"),
        QueryParam("namespace", {"type": "string"}, "one namespace, as the tree names it"))))
async def cache_tree(request: web.Request) -> web.Response:
    state = request.app[STATE]
    limit = _int_param(request, "limit", DEFAULT_TREE_LIMIT, 1, MAX_TREE_LIMIT)
    namespace = request.query.get("namespace") or None
    own = caller_namespace(request)
    show_text = state.config.ui_show_text
    tree = state.engine.cache_tree(limit, namespace, label_key=request.app[UI].label_key,
                                   reveal=lambda ns: show_text and ns == own)
    revealed = [e for e in tree["nodes"] if "token_ids" in e]
    if revealed:                       # tokenizer work stays off the event loop
        await asyncio.get_running_loop().run_in_executor(None, _add_text, state, revealed)
    tree["show_text"] = show_text
    tree["your_namespace"] = namespace_id(own)
    return json_response(tree)


# ---------------------------------------------------------------------- GET /cache/events
def _interval_param(request: web.Request) -> float:
    raw = request.query.get("interval")
    if raw is None:
        return DEFAULT_EVENTS_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not MIN_EVENTS_INTERVAL_S <= value <= MAX_EVENTS_INTERVAL_S:   # also refuses nan
        raise bad_request("interval", f"interval is in seconds, between {MIN_EVENTS_INTERVAL_S} "
                                      f"and {MAX_EVENTS_INTERVAL_S}; got {raw!r}")
    return value


def snapshot(state: ServerState) -> dict:
    """`/cache/stats` plus a timestamp and the engine's token and request counters."""
    body = cache_stats_body(state)
    s = state.engine.stats()
    body["time"] = time.time()
    body["engine"] = {"steps": s.steps, "prompt_tokens": s.prompt_tokens,
                      "generation_tokens": s.generation_tokens,
                      "requests_finished": sum(s.requests_finished.values())}
    return body


@documented(RouteDoc(
    "Server-sent cache snapshots, one per interval, until the client leaves",
    media="text/event-stream", errors=(400,), query=(
        QueryParam("interval", {"type": "number", "minimum": MIN_EVENTS_INTERVAL_S,
                                "maximum": MAX_EVENTS_INTERVAL_S}, "seconds between events"),)))
async def cache_events(request: web.Request) -> web.StreamResponse:
    state, ui = request.app[STATE], request.app[UI]
    interval = _interval_param(request)
    response = web.StreamResponse(headers=sse.HEADERS)
    await response.prepare(request)
    try:
        while not ui.closing.is_set() and not state.draining:
            await response.write(sse.event(snapshot(state)))
            try:
                await asyncio.wait_for(ui.closing.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
    except ConnectionResetError:
        pass
    return response


async def _end_streams(app: web.Application) -> None:
    app[UI].closing.set()


def add_routes(app: web.Application) -> None:
    app[UI] = UiState()
    app.on_shutdown.append(_end_streams)
    app.router.add_get(UI_PATH, ui_page)
    app.router.add_get("/cache/tree", cache_tree)
    app.router.add_get("/cache/events", cache_events)
