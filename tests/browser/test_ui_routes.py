"""GET /ui, /cache/tree and /cache/events over plain HTTP, against the real engine: shapes,
privacy (hash + length unless --ui-show-text, and then only the caller's own namespace),
API keys, bad parameters, and SSE streams that end when the server stops."""

from __future__ import annotations

import pytest

from radixserve.server.app import ServerConfig
from radixserve.server.auth import AuthConfig
from tests.browser.client import KNOWN_PROMPTS, EventStream, complete, get
from tests.browser.conftest import live_server


def node_entries(tree: dict) -> list[dict]:
    return [e for e in tree["nodes"] if e["kind"] == "node"]


@pytest.fixture(scope="module")
def server(model_fp32):
    with live_server(model_fp32) as srv:
        yield srv


@pytest.fixture()
def fresh(server):
    """The module's server with an empty cache; its invariants checked afterwards."""
    server.wait_idle()
    server.run(server.engine.flush_cache())
    yield server
    server.check_invariants()


def test_tree_names_known_prompts_by_hash_and_length(fresh):
    for prompt in KNOWN_PROMPTS:
        complete(fresh, prompt)
    fresh.wait_idle()
    r = get(fresh.url + "/cache/tree")
    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
    tree = r.json()
    stats = get(fresh.url + "/cache/stats").json()
    assert tree["cached_tokens"] == stats["cache"]["cached_tokens"] > 0
    assert tree["nodes"][0] == {"id": "root", "parent": None, "kind": "root",
                                "subtree_tokens": tree["cached_tokens"],
                                "subtree_nodes": tree["num_nodes"]}
    tops = [e for e in tree["nodes"] if e["parent"] == "ns:default"]
    assert len(tops) == len(KNOWN_PROMPTS)
    lengths = sorted(len(fresh.engine.tokenizer.encode(p)) for p in KNOWN_PROMPTS)
    # a completion caches its prompt and all but its last generated token
    assert sorted(e["subtree_tokens"] for e in tops) == [n + 2 for n in lengths]
    for e in node_entries(tree):
        assert len(e["hash"]) == 12 and "text" not in e and "token_ids" not in e
        assert not e["locked"]
    assert tree["show_text"] is False and tree["your_namespace"] == "default"
    again = get(fresh.url + "/cache/tree?limit=3").json()    # the namespace + 2 nodes
    assert [e["hash"] for e in node_entries(again)] == [e["hash"] for e in node_entries(tree)][:2]
    assert again["shown_nodes"] == 2 and again["folded_nodes"] == tree["num_nodes"] - 2
    assert any(e["kind"] == "other" for e in again["nodes"])
    only = get(fresh.url + "/cache/tree?namespace=default").json()
    assert only["namespace"] == "default" and only["shown_nodes"] == tree["shown_nodes"]
    assert get(fresh.url + "/cache/tree?namespace=salt-nobody").json()["shown_nodes"] == 0


@pytest.mark.parametrize("query, param", [
    ("/cache/tree?limit=0", "limit"), ("/cache/tree?limit=501", "limit"),
    ("/cache/tree?limit=ten", "limit"), ("/cache/events?interval=0", "interval"),
    ("/cache/events?interval=nan", "interval"), ("/cache/events?interval=soon", "interval"),
    ("/cache/events?interval=61", "interval"),
])
def test_bad_parameters_are_openai_errors(server, query, param):
    r = get(server.url + query)
    assert r.status == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert get(server.url + "/health").status == 200


def test_events_stream_counter_snapshots(fresh):
    with EventStream(fresh.url + "/cache/events?interval=0.1") as stream:
        assert stream.status == 200 and stream.headers["content-type"] == "text/event-stream"
        snapshots = stream.snapshots()
        first = next(snapshots)
        pool = first["pool"]
        assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]
        assert set(first) >= {"time", "cache", "prefix_cache", "pool", "requests", "engine"}
        complete(fresh, KNOWN_PROMPTS[0])
        complete(fresh, KNOWN_PROMPTS[0])        # the same prompt again: a hit
        seen = [first]
        for snap in snapshots:                  # until a snapshot shows both requests done
            seen.append(snap)
            if snap["engine"]["requests_finished"] >= first["engine"]["requests_finished"] + 2:
                break
        last = seen[-1]
        assert all(b["time"] > a["time"] for a, b in zip(seen, seen[1:]))
        assert last["prefix_cache"]["hit_tokens"] > first["prefix_cache"]["hit_tokens"]
        assert last["prefix_cache"]["hit_rate"] > 0
        assert last["engine"]["generation_tokens"] >= first["engine"]["generation_tokens"] + 6
        assert last["cache"]["cached_tokens"] > 0


def test_event_streams_end_when_the_server_stops(model_fp32):
    srv = live_server(model_fp32)
    with srv:
        stream = EventStream(srv.url + "/cache/events?interval=60")
        snapshots = stream.snapshots()
        assert next(snapshots)["requests"]["running"] == 0
    # the server has stopped: the stream ends (EOF), it does not hang for the 60 s interval
    assert list(snapshots) == []
    stream.close()


def test_api_key_guards_the_data_routes_but_not_the_page_shell(model_fp32):
    config = ServerConfig(port=0, auth=AuthConfig(("sekrit",)))
    with live_server(model_fp32, config) as srv:
        for path in ("/cache/tree", "/cache/events", "/cache/stats"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = get(srv.url + path, headers=headers)
                assert r.status == 401, path
                assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer sekrit"}
        assert get(srv.url + "/cache/tree", headers=good).status == 200
        with EventStream(srv.url + "/cache/events", headers=good) as stream:
            assert stream.status == 200 and next(stream.snapshots())["pool"]["pages_total"] > 0
        page = get(srv.url + "/ui")             # the shell holds no data; it asks for the key
        assert page.status == 200 and page.headers["content-type"].startswith("text/html")
        assert '<meta name="radixserve-auth" content="required">' in page.text
        assert "script-src 'sha256-" in page.headers["content-security-policy"]


def test_show_text_reveals_only_the_callers_own_namespace(model_fp32):
    config = ServerConfig(port=0, auth=AuthConfig(("alice-key", "bob-key"),
                                                  namespace_per_api_key=True),
                          ui_show_text=True)
    with live_server(model_fp32, config) as srv:
        complete(srv, "Alice's secret recipe uses saffron.", key="alice-key")
        complete(srv, "Bob's secret recipe uses cardamom.", key="bob-key")
        complete(srv, "Alice's salted note about figs.", key="alice-key", cache_salt="s1")
        srv.wait_idle()

        def texts(key: str, query: str = "") -> dict[str, list[str]]:
            tree = get(srv.url + "/cache/tree" + query,
                       headers={"Authorization": f"Bearer {key}"}).json()
            out: dict[str, list[str]] = {}
            for e in node_entries(tree):
                out.setdefault(e["namespace"], []).append(e.get("text"))
            return out

        alice, bob = texts("alice-key"), texts("bob-key")
        assert len(alice) == 3                   # alice, bob, and alice's salted namespace
        alice_ns = next(ns for ns, t in alice.items() if any(x and "saffron" in x for x in t))
        bob_ns = next(ns for ns, t in bob.items() if any(x and "cardamom" in x for x in t))
        assert alice_ns != bob_ns
        for who, seen, own in (("alice", alice, alice_ns), ("bob", bob, bob_ns)):
            for ns, node_texts in seen.items():
                assert all(t is not None for t in node_texts) == (ns == own), (who, ns)
                assert any(t is not None for t in node_texts) == (ns == own), (who, ns)
        # with her salt, alice sees her salted namespace ("key-…/salt-…") and nothing else
        salted = texts("alice-key", "?cache_salt=s1")
        salted_ns = next(ns for ns in salted if "/" in ns)
        assert salted_ns.startswith(alice_ns + "/salt-")
        assert all(t is not None for t in salted[salted_ns])
        assert "figs" in "".join(salted[salted_ns])
        assert all(t is None for ns, ts in salted.items() if ns != salted_ns for t in ts)
