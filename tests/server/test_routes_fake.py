"""Routes, response shapes, auth, limits and lifecycle against a contract-following fake
engine (exact token timing and queue control); the Show tests use the real engine."""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.server.state import ServerConfig
from radixserve.server.auth import AuthConfig
from tests.server import http
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer

REPLY = "Hello from the fake engine. " * 20
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def fake():
    engine = FakeEngine()
    with LiveServer(engine) as server:
        yield server
        server.check_invariants()


def client(server, key="none"):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)


def test_chat_stream_chunks_and_usage(fake):
    chunks = list(client(fake).chat.completions.create(
        model="fake-model", messages=MSG, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ("[0]" + REPLY)[:12]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_logprobs_and_usage_aggregate(fake):
    r = client(fake).chat.completions.create(model="fake-model", messages=MSG, max_tokens=5, n=2,
                                             logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for i, c in enumerate(r.choices):
        assert c.message.content == (f"[{i}]" + REPLY)[:5]
        assert len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
    assert r.usage.prompt_tokens == len(fake.engine.tokenizer.apply_chat_template(MSG))
    assert r.usage.completion_tokens == 10
    # the same prompt again: the fake reports its whole prefix (minus one token) cached
    r2 = client(fake).chat.completions.create(model="fake-model", messages=MSG, max_tokens=2)
    assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_completions_logprobs_echo_and_stop(fake):
    c = client(fake)
    r = c.completions.create(model="fake-model", prompt="abc", max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "[0]Hel"
    assert lp.tokens == list("[0]Hel") and len(lp.token_logprobs) == 6
    assert lp.text_offset == list(range(6)) and all(len(d) <= 2 for d in lp.top_logprobs)
    r = c.completions.create(model="fake-model", prompt="abc", max_tokens=6, echo=True)
    assert r.choices[0].text == "abc[0]Hel"
    r = c.completions.create(model="fake-model", prompt=[97, 98], max_tokens=40, stop=["fake"])
    # (the fake does not hold back partial stop strings; the real engine's test checks text)
    assert r.choices[0].text.startswith("[0]Hello from the ") and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="fake-model", prompt="abc", max_tokens=40, stop=["fake"], stream=True, echo=True))
    assert streamed.startswith("abc[0]Hello from the ") and len(streamed) < 30


def test_models_health_and_generate(fake):
    models = client(fake).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert http.get(fake.url + "/health").json() == {"status": "ok"}
    r = http.post(fake.url + "/generate", json={"input_ids": [1, 2, 3],
                                                 "sampling_params": {"max_new_tokens": 4, "logprobs": 1}})
    body = r.json()
    assert r.status == 200 and body["text"] == "[0]H" and body["output_ids"] == list(b"[0]H")
    meta = body["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["finish_reason"] == "length" and meta["e2e_latency_s"] >= meta["ttft_s"] >= 0
    assert len(body["logprobs"]) == 4
    with http.SSEStream(fake.url + "/generate",
                        {"text": "hey", "stream": True, "sampling_params": {"max_tokens": 3}}) as s:
        events = list(s.events())
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert "".join(p["text"] for p in parsed) == "[0]" and parsed[-1]["meta_info"]["prompt_tokens"] == 3


def test_errors_are_openai_shaped():
    engine = FakeEngine()
    with LiveServer(engine, ServerConfig(port=0, max_body_bytes=4096)) as server:
        r = http.get(server.url + "/nope")
        assert r.status == 404 and r.json()["error"]["type"] == "not_found_error"
        r = http.get(server.url + "/v1/chat/completions")
        assert r.status == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = http.post(server.url + "/v1/completions", json={"prompt": "x" * 5000})
        assert r.status == 413 and r.json()["error"]["code"] == "body_too_large"
        r = http.post(server.url + "/v1/completions", body=b"{nope")
        assert r.status == 400 and r.json()["error"]["code"] == "invalid_json"
        r = http.post(server.url + "/generate", json={"input_ids": [1, 300]})
        assert r.status == 400 and r.json()["error"]["param"] == "input_ids[1]"
        r = http.post(server.url + "/generate", json={"text": "a", "input_ids": [1]})
        assert r.status == 400 and r.json()["error"]["param"] == "text"
        assert http.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status == 200
        server.check_invariants()


def test_queue_full_is_503_with_retry_after():
    with LiveServer(FakeEngine(max_live=0), ServerConfig(port=0, retry_after_s=7)) as server:
        for stream in (False, True):
            r = http.post(server.url + "/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status == 503 and r.headers["retry-after"] == "7"
            assert r.json()["error"]["code"] == "queue_full"
        server.check_invariants()


def test_flush_refused_while_running():
    engine = FakeEngine()
    engine.gate = asyncio.Event()       # the request stays live until the test opens the gate
    with LiveServer(engine) as server:
        with http.SSEStream(server.url + "/v1/completions",
                            {"prompt": "x", "max_tokens": 30, "stream": True}) as s:
            r = http.post(server.url + "/cache/flush")
            assert r.status == 409 and r.json()["error"]["type"] == "conflict_error"
            server.call(engine.gate.set)
            assert list(s.events())[-1] == "[DONE]"
        server.wait_idle()
        r = http.post(server.url + "/cache/flush")
        assert r.status == 200 and r.json()["flushed"] is True
        server.check_invariants()


def test_api_keys_and_per_key_namespaces():
    auth = AuthConfig(("key-a", "key-b"), namespace_per_api_key=True)
    engine = FakeEngine()
    with LiveServer(engine, ServerConfig(port=0, auth=auth)) as server:
        assert http.get(server.url + "/health").status == 200
        for path in ("/v1/models", "/metrics", "/cache/stats"):
            assert http.get(server.url + path).status == 401
            assert http.get(server.url + path, headers={"Authorization": "Bearer nope"}).status == 401
        with pytest.raises(openai.AuthenticationError):
            client(server, "wrong").completions.create(model="fake-model", prompt="x", max_tokens=1)
        for key in ("key-a", "key-b", "key-a"):
            client(server, key).completions.create(model="fake-model", prompt="x", max_tokens=1)
        client(server, "key-a").completions.create(model="fake-model", prompt="x", max_tokens=1,
                                                   extra_body={"cache_salt": "s"})
        ns = [call[2] for call in engine.calls]
        assert ns[0] == ns[2] and ns[0] != ns[1] and ns[3] not in (ns[0], ns[1])
        assert all(n is not None and "key-" in n and "key-a" not in n for n in ns)
        server.check_invariants()


def test_client_disconnect_aborts_the_request():
    engine = FakeEngine(delay_s=0.01)
    with LiveServer(engine) as server:
        for path, body in (("/v1/chat/completions", {"messages": MSG}),
                           ("/generate", {"text": "x"})):
            with http.SSEStream(server.url + path, {**body, "max_tokens": 400, "stream": True}) as s:
                events = s.events()
                for _ in range(3):
                    next(events)
            server.wait_idle()
        # a non-streaming client that gives up is aborted too (handler cancellation)
        with pytest.raises(socket.timeout):
            http.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400},
                       timeout=0.3)
        server.wait_idle()
        assert len(engine.aborted) == 3
        server.check_invariants()


def test_metrics_count_and_time(fake):
    c = client(fake)
    for _ in range(3):
        c.completions.create(model="fake-model", prompt="abcd", max_tokens=4)
    text = http.get(fake.url + "/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("radixserve_prompt_tokens_total", ())] == 12
    assert samples[("radixserve_generation_tokens_total", ())] == 12
    assert samples[("radixserve_prefix_cache_queries_tokens_total", ())] == 12
    assert samples[("radixserve_prefix_cache_hits_tokens_total", ())] == 6      # 3 + 3
    assert samples[("radixserve_time_to_first_token_seconds_count", ())] == 3
    assert samples[("radixserve_inter_token_latency_seconds_count", ())] == 9
    assert samples[("radixserve_e2e_request_latency_seconds_count", ())] == 3
    for state in ("free", "cached", "locked", "private"):
        assert ("radixserve_kv_pages", (("state", state),)) in samples
    assert ("radixserve_running_requests", ()) in samples
    stats = http.get(fake.url + "/cache/stats").json()
    pool = stats["pool"]
    assert stats["prefix_cache"]["hit_tokens"] == 6 and pool["tokens_total"] == 1024
    assert pool["pages_cached"] == 12                   # the fake caches its three prompts
    assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]


def test_stream_headers_go_out_at_once_with_keepalive_while_queued():
    engine = FakeEngine()
    engine.gate = asyncio.Event()       # the fake emits nothing until the test opens the gate
    with LiveServer(engine, ServerConfig(port=0, sse_keepalive_s=0.05)) as server:
        with http.SSEStream(server.url + "/v1/completions",
                            {"prompt": "x", "max_tokens": 3, "stream": True}) as s:
            assert s.status == 200          # headers arrived while the request is still queued
            assert s.response.readline() == b": keep-alive\n"
            server.call(engine.gate.set)
            events = list(s.events())
        assert events[-1] == "[DONE]" and len(events) == 4
        server.check_invariants()


def test_health_reports_an_engine_failure():
    engine = FakeEngine()
    with LiveServer(engine) as server:
        assert http.get(server.url + "/health").status == 200
        engine.error = "the engine loop failed: AssertionError('pages leaked')"
        r = http.get(server.url + "/health")
        assert r.status == 503 and r.json() == {"status": "unhealthy", "error": engine.error}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_posts_must_be_json(fake, content_type):
    body = b'{"prompt": "x", "max_tokens": 1}'
    for path in ("/v1/completions", "/generate", "/cache/flush"):
        r = http.post(fake.url + path, body=body, content_type=content_type)
        assert r.status == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert fake.engine.calls == []
    assert http.post(fake.url + "/v1/completions", body=body).status == 200


def test_cross_origin_posts_are_refused():
    config = ServerConfig(port=0, allowed_origins=("http://tool.example:3000",))
    with LiveServer(FakeEngine(), config) as server:
        body = {"prompt": "x", "max_tokens": 1}
        for origin in ("http://evil.example", "null", "http://localhost:8000"):
            r = http.post(server.url + "/v1/completions", json=body, headers={"Origin": origin})
            assert r.status == 403 and r.json()["error"]["code"] == "origin_not_allowed"
            r = http.post(server.url + "/cache/flush", headers={"Origin": origin})
            assert r.status == 403
        assert server.engine.calls == []
        for origin in (server.url, "http://tool.example:3000"):       # same origin; allowed
            r = http.post(server.url + "/v1/completions", json=body, headers={"Origin": origin})
            assert r.status == 200
        assert http.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"}).status == 200
        server.check_invariants()


def test_unsupported_features_are_400_and_bad_keys_invalid_request():
    auth = AuthConfig(("k",))
    with LiveServer(FakeEngine(), ServerConfig(port=0, auth=auth)) as server:
        with pytest.raises(openai.BadRequestError):
            client(server, "k").chat.completions.create(model="fake-model", messages=MSG,
                                                        logit_bias={"1": 1.0})
        with pytest.raises(openai.AuthenticationError) as info:
            client(server, "wrong").models.list()
        assert info.value.body["type"] == "invalid_request_error"
        server.check_invariants()


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x", "n": 2}),
                                        ("/generate", {"text": "x"})])
def test_drain_ends_streams_with_abort_events_without_waiting_for_the_engine(path, body):
    engine = FakeEngine()
    engine.gate = asyncio.Event()       # an engine stuck in a long step: it never answers
    with LiveServer(engine) as server:
        with http.SSEStream(server.url + path, {**body, "max_tokens": 5, "stream": True}) as s:
            drained = server.drain(grace_s=0.5)
            events = list(s.events())
        drained.result(60)
        assert events[-1] == "[DONE]"
        parsed = [json.loads(e) for e in events[:-1]]
        if path == "/generate":
            assert parsed[-1]["finished"] and parsed[-1]["meta_info"]["finish_reason"] == "abort"
        else:
            reasons = sorted(c["choices"][0]["index"] for c in parsed
                             if c.get("choices") and c["choices"][0]["finish_reason"] == "abort")
            assert reasons == [0, 1] and parsed[-1]["error"]["code"] == "aborted"
        server.call(engine.gate.set)    # the step ends: the engine's abort lands
        server.wait_idle()
        assert engine.aborted
