"""The EngineClient protocol is honest: the local Engine, the Ray client and the fake engine
each have every member, and each admin call is a coroutine in all three."""

import inspect

import pytest

from radixserve.cluster.client import ClientConfig, RayEngineClient
from radixserve.cluster.view import ClusterState
from radixserve.engine.engine import Engine
from radixserve.engine.errors import Unsupported
from radixserve.server.engine_client import EngineClient

from .fake_engine import FakeEngine

MEMBERS = [n for n in dir(EngineClient) if not n.startswith("_")]
ADMIN_CALLS = ["flush_cache", "flush_namespace", "namespace_stats", "save_cache", "pin",
               "unpin"]


@pytest.mark.parametrize("cls", [Engine, RayEngineClient, FakeEngine], ids=lambda c: c.__name__)
def test_every_member_and_the_same_kind_of_call(cls):
    assert {"config", "describe_kv_cache", "cache_tree"} <= set(MEMBERS)
    for name in MEMBERS:
        if name in ("config", "max_model_len", "tokenizer", "ready", "error"):
            continue                # attributes and properties: checked on instances below
        assert hasattr(cls, name), f"{cls.__name__} has no {name}"
        wanted = inspect.iscoroutinefunction(getattr(EngineClient, name))
        got = inspect.iscoroutinefunction(getattr(cls, name))
        assert got == wanted, f"{cls.__name__}.{name}: async {got}, the protocol's {wanted}"
    for name in ADMIN_CALLS:
        assert inspect.iscoroutinefunction(getattr(cls, name)), name


def test_the_fake_engine_is_an_engine_client_and_its_config_names_the_model():
    engine = FakeEngine()
    assert isinstance(engine, EngineClient)
    assert engine.config.model == "fake-model"


def test_the_ray_clients_config_is_its_own_type_and_only_after_start():
    client = RayEngineClient(None, ClusterState(16), num_replicas=1)
    assert not client.ready
    with pytest.raises(RuntimeError, match="start"):
        client.config
    client._config = ClientConfig("m", 128, 1)
    assert client.ready and client.config.model == "m"
    assert client.describe_kv_cache() is None
    with pytest.raises(Unsupported, match="--replicas"):
        client.cache_tree(10, label_key=b"k", reveal=lambda ns: False)


def test_an_engine_without_one_tree_answers_the_tree_view_with_409():
    """RayEngineClient and the fake raise Unsupported for /cache/tree: a 409 naming it, not
    a 500 from a missing method; the server keeps serving."""
    from tests.server import http
    from tests.server.live import LiveServer

    with LiveServer(FakeEngine()) as server:
        r = http.get(server.url + "/cache/tree")
        assert r.status == 409
        assert r.json()["error"]["code"] == "unsupported"
        assert http.get(server.url + "/health").status == 200
        server.check_invariants()
