"""Table-driven bad input against a live server on the real engine: each request gets its
documented status and an OpenAI error body naming the field; the server keeps serving and
every KV page is accounted for afterwards."""

from __future__ import annotations

import json

import pytest

from radixserve.server.state import ServerConfig
from radixserve.server.auth import AuthConfig
from tests.server import http
from tests.server.conftest import MAX_MODEL_LEN, MODEL, make_engine
from tests.server.live import LiveServer

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": "Bearer admin-key"}
BODY_LIMIT = 64 * 1024
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (name, method, path, body (dict -> JSON, bytes -> raw), headers, status, error type, param)
CASES = [
    ("malformed JSON", "POST", CHAT, b'{"messages": [', AUTH, 400, "invalid_request_error", None),
    ("body not an object", "POST", CHAT, b"[1, 2]", AUTH, 400, "invalid_request_error", None),
    ("missing messages", "POST", CHAT, {"model": MODEL}, AUTH, 400, "invalid_request_error", "messages"),
    ("empty messages", "POST", CHAT, {"messages": []}, AUTH, 400, "invalid_request_error", "messages"),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400,
     "invalid_request_error", "messages[0].role"),
    ("content of wrong type", "POST", CHAT, {"messages": [{"role": "user", "content": 7}]}, AUTH,
     400, "invalid_request_error", "messages[0].content"),
    ("max_tokens a string", "POST", CHAT, {"messages": MSGS, "max_tokens": "ten"}, AUTH, 400,
     "invalid_request_error", "max_tokens"),
    ("negative max_tokens", "POST", CHAT, {"messages": MSGS, "max_tokens": -5}, AUTH, 400,
     "invalid_request_error", "max_tokens"),
    ("huge max_tokens", "POST", CHAT, {"messages": MSGS, "max_tokens": 10**12}, AUTH, 400,
     "invalid_request_error", "max_tokens"),
    ("temperature too high", "POST", CHAT, {"messages": MSGS, "temperature": 9.5}, AUTH, 400,
     "invalid_request_error", "temperature"),
    ("n out of range", "POST", CHAT, {"messages": MSGS, "n": 1000}, AUTH, 400,
     "invalid_request_error", "n"),
    ("prompt longer than the context", "POST", "/v1/completions",
     {"prompt": [17] * (MAX_MODEL_LEN + 10), "max_tokens": 4}, AUTH, 400, "invalid_request_error", "prompt"),
    ("chat prompt longer than the context", "POST", CHAT,
     {"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]}, AUTH, 400,
     "invalid_request_error", "messages"),
    ("batched prompts", "POST", "/v1/completions", {"prompt": ["a", "b"]}, AUTH, 400,
     "invalid_request_error", "prompt"),
    ("tools", "POST", CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, AUTH, 400,
     "invalid_request_error", "tools[0].function"),
    ("out-of-vocabulary ids", "POST", "/generate", {"input_ids": [1, 10**7, 3]}, AUTH, 400,
     "invalid_request_error", "input_ids[1]"),
    ("negative ids", "POST", "/generate", {"input_ids": [-1]}, AUTH, 400,
     "invalid_request_error", "input_ids[0]"),
    ("oversized body", "POST", CHAT,
     {"messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]}, AUTH, 413,
     "invalid_request_error", None),
    ("wrong API key", "POST", CHAT, {"messages": MSGS}, {"Authorization": "Bearer nope"}, 401,
     "invalid_request_error", None),
    ("no API key", "GET", "/v1/models", None, {}, 401, "invalid_request_error", None),
    ("unknown model", "POST", CHAT, {"model": "gpt-4", "messages": MSGS}, AUTH, 404,
     "not_found_error", "model"),
    ("unknown route", "GET", "/v2/whatever", None, AUTH, 404, "not_found_error", None),
]


@pytest.fixture(scope="module")
def server(loaded_model):
    config = ServerConfig(port=0, auth=AuthConfig((KEY,), admin_keys=("admin-key",)),
                          max_body_bytes=BODY_LIMIT)
    with LiveServer(make_engine(loaded_model), config) as srv:
        yield srv


@pytest.mark.parametrize("name, method, path, body, headers, status, etype, param", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_request_gets_documented_error(server, name, method, path, body, headers, status,
                                           etype, param):
    raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    r = http.request(method, server.url + path, body=raw,
                     headers={"Content-Type": "application/json", **headers})
    assert r.status == status, r.body
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == etype and error["param"] == param and error["message"]
    if param:
        assert param.split("[")[0].split(".")[-1] in error["message"]
    # the server keeps serving, and nothing leaked
    ok = http.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                   headers=AUTH)
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    server.check_invariants()


def test_health_needs_no_key_and_flush_is_409_while_busy(server):
    assert http.get(server.url + "/health").status == 200
    with http.SSEStream(server.url + "/v1/completions", headers=AUTH,
                        json={"prompt": "Tell me a story", "max_tokens": 1900, "ignore_eos": True,
                              "stream": True}) as s:
        events = s.events()
        next(events)
        r = http.post(server.url + "/cache/flush", headers=ADMIN)
        assert r.status == 409 and r.json()["error"]["type"] == "conflict_error"
    server.wait_idle()
    # keys without --namespace-per-api-key share one namespace: only an admin may flush it
    r = http.post(server.url + "/cache/flush", headers=AUTH)
    assert r.status == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert http.get(server.url + "/cache/stats", headers=AUTH).status == 403
    before = http.get(server.url + "/cache/stats", headers=ADMIN).json()["pool"]
    assert before["pages_cached"] > 0
    r = http.post(server.url + "/cache/flush", headers=ADMIN)
    assert r.status == 200 and r.json()["flushed"] is True
    assert r.json()["freed_pages"] == before["pages_cached"]
    stats = http.get(server.url + "/cache/stats", headers=ADMIN).json()
    pool = stats["pool"]
    assert stats["cache"]["cached_tokens"] == 0 and pool["pages_cached"] == 0
    assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]
    assert pool["pages_free"] == pool["pages_total"]          # idle and flushed: all free
    server.check_invariants()


def test_full_queue_is_503_with_retry_after(loaded_model):
    with LiveServer(make_engine(loaded_model, max_queue_len=0, kv_cache_tokens=4096)) as srv:
        for stream in (False, True):
            r = http.post(srv.url + "/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        srv.check_invariants()
