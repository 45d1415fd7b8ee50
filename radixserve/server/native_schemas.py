"""Response shapes of the native routes that answer with plain dicts (/generate, /health,
the cache routes), declared as msgspec types so that `/openapi.json` can describe them.

The handlers build dicts; these types are the documented contract, and the Schemathesis
test (tests/server/test_openapi_fuzz.py) checks every live response against them, so a
handler that drifts from its type fails there. Unknown extra keys are allowed (clients
should ignore fields they do not know), missing required ones are not.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct


class GenerateMeta(Struct, kw_only=True):
    id: str
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_latency_s: float | None
    error: str | None = None


class GenerateResponse(Struct, kw_only=True):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta
    logprobs: list[dict[str, Any]] | None = None


class GenerateEvent(Struct, kw_only=True):
    """One server-sent event of a streamed /generate (the last one carries meta_info)."""

    text: str
    output_ids: list[int]
    finished: bool
    logprobs: list[dict[str, Any]] | None = None
    meta_info: GenerateMeta | None = None


class HealthResponse(Struct, kw_only=True):
    status: Literal["ok", "unhealthy"]
    error: str | None = None


class CacheStatsResponse(Struct, kw_only=True):
    """The whole cache's counters (admin keys, servers without keys), or `namespace` alone
    (a tenant key's own namespace)."""

    cache: dict[str, Any] | None = None
    prefix_cache: dict[str, Any] | None = None
    pool: dict[str, Any] | None = None
    requests: dict[str, Any] | None = None
    kv_disk: dict[str, Any] | None = None
    tiers: dict[str, Any] | None = None
    pins: dict[str, Any] | None = None
    replicas: dict[str, Any] | None = None
    namespace: dict[str, Any] | None = None


class FlushResponse(Struct, kw_only=True):
    flushed: bool
    scope: Literal["all", "namespace"]
    freed_pages: int
    pages_free: int


class SaveResponse(Struct, kw_only=True):
    saved: bool


class CacheTreeResponse(Struct, kw_only=True):
    nodes: list[dict[str, Any]]
    show_text: bool
    your_namespace: str
