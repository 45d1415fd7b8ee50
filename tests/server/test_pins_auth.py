"""Who may pin and unpin (the fake engine; the pinning itself is tested on the real engine
in test_pins.py): tenant keys act on their own namespace only, `namespace` needs an admin
key, another tenant's pin is as unknown as a missing one; with --replicas, one clear 409."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.engine.errors import PinConflict
from radixserve.server.auth import AuthConfig, cache_namespace
from radixserve.server.errors import api_error_from
from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer

A, B, ADMIN = "tenant-a", "tenant-b", "the-admin"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture()
def server():
    auth = AuthConfig((A, B), namespace_per_api_key=True, admin_keys=(ADMIN,))
    with LiveServer(FakeEngine(), ServerConfig(port=0, auth=auth)) as srv:
        yield srv


def pin(server, key: str | None, **body) -> http.Reply:
    return http.post(server.url + "/cache/pin", json=body,
                     headers=bearer(key) if key else None)


def unpin(server, key: str, pin_id: str) -> http.Reply:
    return http.request("DELETE", f"{server.url}/cache/pin/{pin_id}", headers=bearer(key))


def test_tenants_pin_and_unpin_in_their_own_namespace_only(server):
    assert pin(server, None, prompt="hello there").status == 401
    mine = pin(server, A, prompt="hello there", cache_salt="s").json()
    auth = server.config.auth                       # the namespace its requests run in
    assert mine["namespace"] == cache_namespace(auth.key_namespace(A), "s")
    theirs = pin(server, B, prompt="hello there").json()
    assert theirs["id"] != mine["id"] and theirs["cached_tokens"] == 0

    r = pin(server, A, prompt="x", namespace=theirs["namespace"])
    assert r.status == 403 and r.json()["error"]["param"] == "namespace"

    a_view = http.get(server.url + "/cache/stats", headers=bearer(A)).json()["namespace"]
    assert [p["id"] for p in a_view["pins"]] == [mine["id"]]        # B's pin is not listed
    assert unpin(server, A, theirs["id"]).status == 404             # nor deletable by A
    admin = http.get(server.url + "/cache/stats", headers=bearer(ADMIN)).json()["pins"]
    assert {p["id"] for p in admin["prefixes"]} == {mine["id"], theirs["id"]}
    assert "hello" not in http.get(server.url + "/cache/stats", headers=bearer(ADMIN)).text

    assert unpin(server, A, mine["id"]).status == 200
    assert unpin(server, ADMIN, theirs["id"]).status == 200         # an admin unpins any
    assert server.engine.pins == {}


def test_admin_pins_in_a_named_namespace(server):
    tenant = pin(server, A, prompt="shared rules").json()
    by_admin = pin(server, ADMIN, prompt="shared rules", namespace=tenant["namespace"]).json()
    assert (by_admin["id"], by_admin["created"]) == (tenant["id"], False)
    default = pin(server, ADMIN, prompt="shared rules", namespace="default").json()
    assert default["namespace"] == "default" and default["id"] != tenant["id"]


def test_tenant_keys_sharing_one_namespace_need_the_admin_key():
    auth = AuthConfig((A,), admin_keys=(ADMIN,))
    with LiveServer(FakeEngine(), ServerConfig(port=0, auth=auth)) as server:
        r = pin(server, A, prompt="hello")
        assert r.status == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert pin(server, ADMIN, prompt="hello").status == 200


def test_replicas_answer_one_clear_409():
    from radixserve.cluster.client import RayEngineClient

    client = RayEngineClient(handle=None, state=None, num_replicas=2)
    with pytest.raises(PinConflict) as err:
        asyncio.run(client.pin([1, 2, 3]))
    api = api_error_from(err.value)
    assert (api.status, api.code) == (409, "pinning_unsupported")
    assert "--replicas" in api.message and "\n" not in api.message
    assert client.pinned() == []
    assert api_error_from(_raised(lambda pin_id: asyncio.run(client.unpin(pin_id)), "pin-x")).status == 404
    from radixserve.cluster.client import sum_stats
    from radixserve.engine.outputs import EngineStats
    total = sum_stats([EngineStats(pinned_tokens_limit=256, page_size=4)] * 2)
    assert (total.pinned_tokens_limit, total.page_size) == (0, 4)     # nothing pinnable


def _raised(fn, *args) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:    # noqa: BLE001 - the test inspects it
        return exc
    raise AssertionError(f"{fn} did not raise")
