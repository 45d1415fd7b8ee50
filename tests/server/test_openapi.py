"""`/openapi.json` against the router it describes (fake engine): every route is in it,
each with its errors, and a route without a RouteDoc is caught."""

from __future__ import annotations

import pytest
from aiohttp import web

from radixserve.server import openapi
from radixserve.server.app import PUBLIC_PATHS
from tests.server import http
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer


@pytest.fixture(scope="module")
def document():
    with LiveServer(FakeEngine()) as server:
        r = http.get(server.url + "/openapi.json")
        assert r.status == 200 and r.headers["content-type"].startswith("application/json")
        routes = {(route.method, route.resource.canonical)
                  for route in server.server.runner.app.router.routes() if route.method != "HEAD"}
        yield r.json(), routes


def test_every_route_is_documented(document):
    doc, routes = document
    assert doc["openapi"] == "3.1.0"
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    served = {(m, path.replace("{model:.+}", "{model}")) for m, path in routes}
    assert documented == served
    assert ("POST", "/v1/chat/completions") in documented and ("GET", "/openapi.json") in documented


def test_errors_bodies_and_headers_are_described(document):
    doc, _ = document
    schemas = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(chat["responses"]) >= {"200", "400", "401", "408", "413", "415", "500", "503"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert "Retry-After" in chat["responses"]["503"]["headers"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert "temperature" in schemas["ChatCompletionRequest"]["properties"]
    assert set(schemas["ErrorInfo"]["required"]) == {"message", "type", "param", "code"}
    unpin = doc["paths"]["/cache/pin/{pin_id}"]["delete"]
    assert unpin["parameters"][0]["name"] == "pin_id" and "404" in unpin["responses"]
    for path, ops in doc["paths"].items():      # public routes say so, and only they
        for op in ops.values():
            assert (op.get("security") == []) == (path in PUBLIC_PATHS), path
            assert ("401" in op["responses"]) == (path not in PUBLIC_PATHS), path


def test_an_undocumented_route_fails_the_build():
    app = web.Application()

    async def handler(request):
        return web.Response()
    app.router.add_get("/new", handler)
    with pytest.raises(openapi.MissingRouteDoc, match="GET /new"):
        openapi.build_document(app)
