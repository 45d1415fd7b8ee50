"""The server's shared state, config and response helpers: what every route module reads.

Its own module so that app.py (which wires routes) and the route modules (which read the
state) import it and not each other.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import contextmanager
from functools import cached_property
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgspec
from aiohttp import web

from radixserve.server.auth import AuthConfig
from radixserve.server.body_limit import BodyLimit
from radixserve.server.conversations import ConversationConfig, Conversations
from radixserve.server.engine_client import EngineClient
from radixserve.server.errors import ApiError
from radixserve.server.metrics import ServerMetrics
from radixserve.server.prompts import ModelInfo, PromptBuilder, model_info
from radixserve.server.grammar_metrics import GrammarCollector
from radixserve.server.structured import grammar_compiler

@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    auth: AuthConfig = field(default_factory=AuthConfig)
    max_body_bytes: int | None = None     # None: auto, from the context (body_limit.py)
    shutdown_grace_s: float = 30.0
    served_model_name: str | None = None
    retry_after_s: int = 1
    access_log: bool = False
    header_timeout_s: float = 10.0      # a connection must send a request's headers in this
    body_timeout_s: float = 30.0        # ... and its whole body in this (408 otherwise)
    keepalive_timeout_s: float = 15.0   # an idle kept-alive connection is closed after this
    max_connections: int = 1024         # more open connections are answered 503 and closed
    sse_keepalive_s: float = 5.0        # a ': keep-alive' comment while a stream has no token
    allowed_origins: tuple[str, ...] = ()   # cross-origin pages allowed to POST (same-origin is)
    ui_show_text: bool = False      # the cache view may show token text (own namespace only)
    conversations: ConversationConfig = field(default_factory=ConversationConfig)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its key's cache namespace, and whether it may act on every
    tenant (an admin key, or any caller when the server has no keys at all)."""

    key_namespace: str | None = None
    admin: bool = True
    owner: str | None = None        # the key's digest: who may read what it stored


@dataclass(eq=False)
class ServerState:
    """Everything a handler needs, reached through `request.app[STATE]`."""

    engine: EngineClient
    config: ServerConfig
    info: ModelInfo
    metrics: ServerMetrics
    prompts: PromptBuilder
    draining: bool = False
    # request ids being served -> set when the server ends them (shutdown grace ending)
    active: dict[str, asyncio.Event] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    conversations: Conversations | None = None      # stored responses (POST /v1/responses)

    def __post_init__(self) -> None:
        self.idle.set()

    @cached_property
    def body_limit(self) -> BodyLimit:
        return BodyLimit.resolve(self.config.max_body_bytes, self.info.max_model_len)

    @classmethod
    def create(cls, engine: EngineClient, config: ServerConfig) -> "ServerState":
        info = model_info(engine, config.served_model_name)
        metrics = ServerMetrics(engine.stats)
        collector = engine.metrics_collector()      # --replicas N: per replica and router
        if collector is not None:
            metrics.registry.register(collector)
        grammars = grammar_compiler(engine)
        metrics.registry.register(GrammarCollector(grammars.stats, engine.stats))
        return cls(engine=engine, config=config, info=info, metrics=metrics,
                   prompts=PromptBuilder(engine.tokenizer, info, grammars=grammars),
                   conversations=Conversations.for_engine(engine, config.conversations))

    @contextmanager
    def track(self) -> Iterator[str]:
        """A fresh request id, known to the server until the handler is done with it."""
        request_id = uuid.uuid4().hex
        self.active[request_id] = asyncio.Event()
        self.idle.clear()
        try:
            yield request_id
        finally:
            self.active.pop(request_id, None)
            if not self.active:
                self.idle.set()

    def stop_event(self, request_id: str) -> asyncio.Event:
        return self.active[request_id]

    def abort_all(self) -> None:
        """Abort every request being served; streams end at once with their abort events."""
        for request_id, stop in list(self.active.items()):
            self.engine.abort(request_id)
            stop.set()


STATE = web.AppKey("radixserve_state", ServerState)
# request-scoped: who sent it (web.RequestKey exists from aiohttp 3.12)
CALLER = (web.RequestKey("radixserve_caller", Caller) if hasattr(web, "RequestKey")
          else "radixserve_caller")


def caller(request: web.Request) -> Caller:
    return request.get(CALLER) or Caller()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers,
                        content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return json_response(err.body(), status=err.status, headers=err.headers or None)
