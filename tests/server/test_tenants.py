"""Flush and stats scoping on the real engine: two tenant keys with their own namespaces and
an admin key. A tenant flushes and sees only its own namespace (and its salted ones);
flushing everything and the pool-wide counters need the admin key."""

from __future__ import annotations

import pytest

from radixserve.server.auth import AuthConfig
from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.conftest import make_engine
from tests.server.live import LiveServer

K1, K2, ADMIN = "tenant-one", "tenant-two", "the-admin"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(loaded_model):
    auth = AuthConfig((K1, K2), namespace_per_api_key=True, admin_keys=(ADMIN,))
    with LiveServer(make_engine(loaded_model), ServerConfig(port=0, auth=auth)) as srv:
        yield srv


def cached(server, key: str, salt: str | None = None) -> tuple[int, int]:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = http.post(server.url + "/v1/completions", json=body, headers=bearer(key))
    assert r.status == 200, r.body
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def ns_stats(server, key: str) -> dict:
    r = http.get(server.url + "/cache/stats", headers=bearer(key))
    assert r.status == 200 and set(r.json()) == {"namespace"}      # no pool-wide counters
    return r.json()["namespace"]


def test_tenant_flush_and_stats_are_scoped_to_its_namespace(server):
    assert http.post(server.url + "/cache/flush", headers=bearer(ADMIN)).json()["scope"] == "all"
    first, prompt_len = cached(server, K1)
    assert first == 0
    assert cached(server, K1)[0] == prompt_len - 1
    assert cached(server, K1, salt="s")[0] == 0
    assert cached(server, K2)[0] == 0                  # k1's prefixes are not k2's
    k1, k2 = ns_stats(server, K1), ns_stats(server, K2)
    assert k1["cached_tokens"] >= 2 * prompt_len       # its own and its salted namespace
    assert prompt_len <= k2["cached_tokens"] < k1["cached_tokens"]
    server.wait_idle()

    r = http.post(server.url + "/cache/flush", headers=bearer(K2))
    assert r.status == 200 and r.json()["scope"] == "namespace"
    assert r.json()["freed_pages"] == k2["cached_tokens"]            # page size 1
    assert ns_stats(server, K2)["cached_tokens"] == 0
    assert ns_stats(server, K1) == k1                                 # untouched
    assert cached(server, K1)[0] == prompt_len - 1
    assert cached(server, K1, salt="s")[0] == prompt_len - 1

    server.wait_idle()
    k1 = ns_stats(server, K1)
    r = http.post(server.url + "/cache/flush", headers=bearer(K1))   # also its salted one
    assert r.json()["freed_pages"] == k1["cached_tokens"]
    assert ns_stats(server, K1)["cached_tokens"] == 0
    assert cached(server, K1, salt="s")[0] == 0

    admin = http.get(server.url + "/cache/stats", headers=bearer(ADMIN)).json()
    pool = admin["pool"]
    assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]
    assert pool["pages_cached"] > 0
    server.wait_idle()
    r = http.post(server.url + "/cache/flush", headers=bearer(ADMIN))
    assert r.status == 200 and r.json()["freed_pages"] == pool["pages_cached"]
    pool = http.get(server.url + "/cache/stats", headers=bearer(ADMIN)).json()["pool"]
    assert pool["pages_free"] == pool["pages_total"] and pool["pages_cached"] == 0
    server.check_invariants()


def test_metrics_and_stats_need_a_key(server):
    for path in ("/metrics", "/cache/stats"):
        assert http.get(server.url + path).status == 401
        assert http.get(server.url + path, headers=bearer(K1)).status == 200
    assert http.post(server.url + "/cache/flush").status == 401
    assert http.get(server.url + "/health").status == 200
