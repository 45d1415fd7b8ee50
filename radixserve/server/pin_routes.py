"""POST /cache/pin and DELETE /cache/pin/{id}: keep a prefix in the KV pool, never evicted,
until it is unpinned (the engine's side is engine/pins.py).

Scoped like the other cache routes: an admin key (or a server without keys) pins in any
namespace (`namespace`, named as /cache/tree names them) and unpins anything; a tenant key
with `--namespace-per-api-key` pins and unpins only in its own namespace (refined by
`cache_salt`, as its requests are); a tenant key without it gets 403.
"""

from __future__ import annotations

from aiohttp import web

from radixserve.cache.summary import DEFAULT_NAMESPACE, namespace_id
from radixserve.engine.errors import UnknownPin
from radixserve.server import protocol as P
from radixserve.server.body import expect_continue, read_json
from radixserve.server.errors import ApiError
from radixserve.server.openapi import RouteDoc, documented
from radixserve.server.native_api import tenant_namespace, visible_pins
from radixserve.server.prompts import prepare_pin
from radixserve.server.state import STATE, Caller, caller, json_response


def pin_base_namespace(who: Caller, requested: str | None) -> str | None:
    """The namespace a pin lands in before its `cache_salt`: the body's `namespace` (admins
    only), else the caller's own -- as its requests would run."""
    if requested is None:
        return who.key_namespace if who.admin else tenant_namespace(who, "Pinning in")
    if not who.admin:
        raise ApiError(403, "'namespace' needs an admin key (--admin-api-key); a tenant key "
                            "pins in its own namespace", type="permission_error",
                       param="namespace", code="admin_key_required")
    return None if requested == DEFAULT_NAMESPACE else requested


@documented(RouteDoc("Pin a prefix in the KV pool", body=P.PinRequest, response=P.PinResponse,
                     errors=(409,)))
async def pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, P.PinRequest)
    who = caller(request)
    base = pin_base_namespace(who, req.namespace)
    prompt_ids, namespace = await prepare_pin(req, state.prompts, base)
    info = await state.engine.pin(prompt_ids, namespace)
    return json_response(P.PinResponse(info.pin_id, "cache.pin", info.tokens, info.cached_tokens,
                                       len(prompt_ids), namespace_id(info.namespace),
                                       info.created))


@documented(RouteDoc("Unpin a prefix", response=P.UnpinResponse, errors=(404,)))
async def unpin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pin_id = request.match_info["pin_id"]
    mine = {p.pin_id for p in visible_pins(caller(request), state.engine.pinned())}
    if pin_id not in mine:          # another tenant's pin is as unknown as a missing one
        raise UnknownPin(f"no pinned prefix has the id {pin_id[:100]!r}")
    info = await state.engine.unpin(pin_id)
    return json_response(P.UnpinResponse(info.pin_id, "cache.pin", True, info.tokens,
                                         namespace_id(info.namespace)))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/cache/pin", pin, expect_handler=expect_continue)
    app.router.add_delete("/cache/pin/{pin_id}", unpin)
