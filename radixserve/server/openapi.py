"""`GET /openapi.json`: an OpenAPI 3.1 document generated from the live router and the
msgspec types, so it cannot drift from what the server does.

Each handler carries its `RouteDoc` (the `documented` decorator, next to the handler);
the document walks `app.router` and reads them, and the schemas come from
`msgspec.json.schema_components` over the types the docs name. A route registered without
a `RouteDoc` makes `build_document` raise (and tests/server/test_openapi.py fail), so a new
route is documented where it is written, in one place. Errors share one body
(`errors.ErrorBody`); the statuses every route or every POST may answer are added here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import msgspec
from aiohttp import web

from radixserve.server.errors import ErrorBody
from radixserve.server.state import STATE, json_response

__all__ = ["RouteDoc", "QueryParam", "documented", "build_document", "add_routes",
           "OPENAPI_PATH", "MissingRouteDoc"]

OPENAPI_PATH = "/openapi.json"
DOC_ATTR = "openapi_doc"
REF = "#/components/schemas/{name}"
H = TypeVar("H", bound=Callable)

# statuses any route may answer (the gate and the error middleware), and any POST
COMMON_ERRORS = {
    500: "internal error (a bug: please report it)",
    503: "draining, warming up, engine unhealthy or queue full; see Retry-After",
}
AUTH_ERRORS = {401: "missing or invalid API key"}
POST_ERRORS = {
    400: "the body does not validate: `error.param` names the field",
    403: "cross-origin POST refused, or the key may not do this",
    408: "the body did not arrive within the body timeout",
    413: "the body is larger than --max-body-bytes (auto: 1 MiB + 64 bytes per context "
         "token); refused by its declared length, the connection closed",
    415: "the body is not declared `application/json`",
}
ERROR_TEXT = {404: "not found", 409: "conflict with the server's state (see error.code)",
              403: "the key may not do this", 400: "a parameter is invalid"}
_PATH_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")


class MissingRouteDoc(RuntimeError):
    """A route was registered without a RouteDoc: document it beside its handler."""


@dataclass(frozen=True)
class QueryParam:
    name: str
    schema: dict[str, Any]
    description: str = ""


@dataclass(frozen=True)
class RouteDoc:
    """What `/openapi.json` says about one handler."""

    summary: str
    body: type | None = None            # the JSON request struct (POST)
    response: type | None = None        # the JSON body of a 200
    stream: type | None = None          # the data of each server-sent event, when streamed
    media: str = "application/json"     # the 200's content type when it is not JSON
    errors: tuple[int, ...] = ()        # route-specific error statuses beyond the common ones
    query: tuple[QueryParam, ...] = ()
    public: bool = False                # no API key needed


def documented(doc: RouteDoc) -> Callable[[H], H]:
    """Attach `doc` to a handler; the router keeps the handler, the document reads it."""
    def mark(handler: H) -> H:
        setattr(handler, DOC_ATTR, doc)
        return handler
    return mark


def route_doc(handler: Callable) -> RouteDoc | None:
    return getattr(handler, DOC_ATTR, None)


def _routes(app: web.Application) -> list[tuple[str, str, RouteDoc]]:
    """(method, path, doc) for every route but the HEADs aiohttp adds beside each GET."""
    out = []
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path = _PATH_PARAM.sub(r"{\1}", route.resource.canonical)
        doc = route_doc(route.handler)
        if doc is None:
            raise MissingRouteDoc(f"{route.method} {path} has no RouteDoc: decorate its handler "
                                  f"with openapi.documented(RouteDoc(...))")
        out.append((route.method, path, doc))
    return out


def _types(docs: list[RouteDoc]) -> list[type]:
    seen: dict[type, None] = {ErrorBody: None}
    for doc in docs:
        for t in (doc.body, doc.response, doc.stream):
            if t is not None:
                seen[t] = None
    return list(seen)


def _error_response(text: str, retry_after: bool) -> dict:
    out: dict[str, Any] = {"description": text,
                           "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorBody")}}}}
    if retry_after:
        out["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                          "schema": {"type": "string"}}}
    return out


def _operation(method: str, path: str, doc: RouteDoc, schemas: dict[type, dict]) -> dict:
    ok_content: dict[str, Any] = {}
    if doc.response is not None:
        ok_content["application/json"] = {"schema": schemas[doc.response]}
    else:
        ok_content[doc.media] = {"schema": {"type": "object" if doc.media == "application/json"
                                            else "string"}}
    if doc.stream is not None:
        ok_content["text/event-stream"] = _event_stream(schemas[doc.stream])
    op: dict[str, Any] = {"summary": doc.summary, "operationId": _operation_id(method, path),
                          "responses": {"200": {"description": "success", "content": ok_content}}}
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
              for name in _PATH_PARAM.findall(path)]
    params += [{"name": q.name, "in": "query", "required": False, "schema": q.schema,
                "description": q.description} for q in doc.query]
    if params:
        op["parameters"] = params
    if doc.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json":
                                                           {"schema": schemas[doc.body]}}}
    errors = dict(COMMON_ERRORS)
    if not doc.public:
        errors.update(AUTH_ERRORS)
    if method == "POST":
        errors.update(POST_ERRORS)
    for status in doc.errors:
        errors.setdefault(status, ERROR_TEXT.get(status, "error"))
    for status in sorted(errors):
        op["responses"][str(status)] = _error_response(errors[status], status == 503)
    if doc.public:
        op["security"] = []
    return op


def _event_stream(data_schema: dict) -> dict:
    """Server-sent events whose `data` is JSON of `data_schema` (OpenAI streams end with a
    `[DONE]` event, hence contentSchema: an annotation, not a constraint). `schema` is how
    3.1 tools read a stream (one event), `itemSchema` how 3.2 tools do."""
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                     "contentSchema": data_schema}}}
    return {"schema": event, "itemSchema": event}


def _operation_id(method: str, path: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")
    return f"{method.lower()}_{words or 'root'}"


def build_document(app: web.Application, title: str = "radixserve",
                   version: str = "0.1.0") -> dict:
    """The OpenAPI 3.1 document of every route `app` serves."""
    routes = _routes(app)
    types = _types([doc for _, _, doc in routes])
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    schemas = dict(zip(types, refs))
    paths: dict[str, dict] = {}
    for method, path, doc in routes:
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, doc, schemas)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible and native routes of a radixserve server; "
                                "errors use OpenAI's body. Generated from the live router."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


OPENAPI = web.AppKey("radixserve_openapi", dict)


@documented(RouteDoc("This document: the server's OpenAPI 3.1 description", public=True))
async def openapi_json(request: web.Request) -> web.Response:
    cached = request.app[OPENAPI]       # the router is frozen once serving: build it once
    if not cached:
        cached.update(build_document(request.app, version=_version()))
    return json_response(cached)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("radixserve")
    except PackageNotFoundError:
        return "0.1.0"


def add_routes(app: web.Application) -> None:
    app[OPENAPI] = {}
    app.router.add_get(OPENAPI_PATH, openapi_json)
