"""POST /cache/pin and DELETE /cache/pin/{id} on the real engine with a small pool: a pinned
system prompt still hits after a flood that evicts everything else, unpinning lets it go,
the budget answers 409 with its numbers, prompt / messages / token_ids name the same prefix,
namespaces isolate, bad bodies are 400s, and pages are conserved after every scenario."""

from __future__ import annotations

import random

import pytest

from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.conftest import make_engine
from tests.server.live import LiveServer

POOL = 1024
LIMIT = 400
SYSTEM = ("You are the support assistant of a bicycle shop. Answer briefly and politely, "
          "quote prices in euros, and never promise a repair date you cannot keep. ") * 2


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = make_engine(loaded_model, kv_cache_tokens=POOL, max_model_len=384,
                         max_pinned_tokens=LIMIT, debug_invariants=True)
    with LiveServer(engine, ServerConfig(port=0)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def conserved(server):
    """Every scenario starts with no pin and ends with pages conserved."""
    yield
    server.check_invariants()
    for pin in stats(server)["pins"]["prefixes"]:
        assert http.request("DELETE", f"{server.url}/cache/pin/{pin['id']}").status == 200
    server.check_invariants()
    assert server.call(lambda: server.engine.tree.locked_tokens) == 0


def stats(server) -> dict:
    body = http.get(server.url + "/cache/stats").json()
    pool = body["pool"]
    assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]
    return body


def pin(server, **body) -> http.Reply:
    return http.post(server.url + "/cache/pin", json=body)


def chat_cached(server, question: str, salt: str | None = None) -> int:
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = http.post(server.url + "/v1/chat/completions", json=body)
    assert r.status == 200, r.body
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def flood(server, n: int = 8, seed: int = 0) -> None:
    """n prompts of 300 random token ids: more than twice the pool."""
    rng = random.Random(seed)
    for _ in range(n):
        ids = [rng.randrange(1000, 40000) for _ in range(300)]
        r = http.post(server.url + "/v1/completions",
                      json={"prompt": ids, "max_tokens": 1, "temperature": 0})
        assert r.status == 200, r.body


def test_pinned_system_prompt_survives_a_flood_and_unpin_releases_it(server):
    r = pin(server, messages=[{"role": "system", "content": SYSTEM}])
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "cache.pin" and body["id"].startswith("pin-")
    assert body["created"] is True and body["namespace"] == "default"
    assert body["pinned_tokens"] == body["prompt_tokens"] > 50      # page size 1: all of it
    assert body["cached_tokens"] == 0
    size = body["pinned_tokens"]

    again = pin(server, messages=[{"role": "system", "content": SYSTEM}]).json()
    assert (again["id"], again["created"], again["pinned_tokens"]) == (body["id"], False, size)

    listed = stats(server)["pins"]
    assert listed == {"pinned_tokens": size, "pinned_prefixes": 1, "max_pinned_tokens": LIMIT,
                      "prefixes": [{"id": body["id"], "pinned_tokens": size,
                                    "namespace": "default"}]}
    metrics = http.get(server.url + "/metrics").text
    assert f"radixserve_pinned_tokens {float(size)}" in metrics
    assert "radixserve_pinned_prefixes 1.0" in metrics

    evicted = stats(server)["prefix_cache"]["evicted_tokens"]
    flood(server)
    assert stats(server)["prefix_cache"]["evicted_tokens"] - evicted > POOL
    assert chat_cached(server, "Do you sell helmets?") >= size      # the pin hit whole
    server.check_invariants()

    r = http.request("DELETE", f"{server.url}/cache/pin/{body['id']}")
    assert r.status == 200
    assert r.json() == {"id": body["id"], "object": "cache.pin", "deleted": True,
                        "pinned_tokens": size, "namespace": "default"}
    assert stats(server)["pins"]["pinned_tokens"] == 0
    assert server.call(lambda: server.engine.tree.locked_tokens) == 0
    flood(server, seed=1)
    assert chat_cached(server, "Can you fix a flat tyre?") < size   # evictable, evicted
    r = http.request("DELETE", f"{server.url}/cache/pin/{body['id']}")
    assert r.status == 404 and r.json()["error"]["code"] == "pin_not_found"


def test_prompt_messages_and_token_ids_name_the_same_prefix(server):
    tok = server.engine.tokenizer
    text = "Bicycle shop opening hours: nine to six on weekdays, ten to four on Saturdays."
    by_text = pin(server, prompt=text).json()
    ids = tok.encode(text)
    assert by_text["pinned_tokens"] == len(ids)
    by_ids = pin(server, token_ids=ids).json()
    assert (by_ids["id"], by_ids["created"]) == (by_text["id"], False)

    messages = [{"role": "system", "content": SYSTEM}]
    plain = pin(server, messages=messages).json()
    assert plain["pinned_tokens"] == len(tok.apply_chat_template(messages,
                                                                 add_generation_prompt=False))
    full = pin(server, messages=messages, add_generation_prompt=True).json()
    rendered = tok.apply_chat_template(messages)            # as a chat request renders them
    assert full["pinned_tokens"] == len(rendered) and full["id"] != plain["id"]
    assert full["cached_tokens"] >= plain["pinned_tokens"]  # the plain pin is its prefix
    assert len(stats(server)["pins"]["prefixes"]) == 3


def test_over_the_budget_is_409_with_the_numbers(server):
    rng = random.Random(3)
    first = [rng.randrange(1000, 40000) for _ in range(300)]
    assert pin(server, token_ids=first).status == 200
    r = pin(server, token_ids=[rng.randrange(1000, 40000) for _ in range(120)])
    assert r.status == 409
    err = r.json()["error"]
    assert err["type"] == "conflict_error" and err["code"] == "pin_limit_exceeded"
    assert (err["requested_tokens"], err["pinned_tokens"], err["max_pinned_tokens"]) \
        == (120, 300, LIMIT)
    assert "120" in err["message"] and "300" in err["message"] and str(LIMIT) in err["message"]
    assert stats(server)["pins"]["pinned_tokens"] == 300
    assert chat_cached(server, "Still serving?") >= 0               # the server goes on


def test_namespaces_isolate_pins(server):
    r = pin(server, prompt=SYSTEM, cache_salt="shop-a")
    body = r.json()
    assert r.status == 200 and body["namespace"].startswith("salt-")
    flood(server, seed=2)
    prompt = SYSTEM + " Which lock do you recommend?"
    salted = http.post(server.url + "/v1/completions",
                       json={"prompt": prompt, "max_tokens": 1, "cache_salt": "shop-a"}).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] >= body["pinned_tokens"] - 1
    other = http.post(server.url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 1, "cache_salt": "shop-b"}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    by_ns = pin(server, prompt=SYSTEM, namespace=body["namespace"]).json()   # admin: by id
    assert by_ns["namespace"] == body["namespace"]
    assert (by_ns["id"], by_ns["created"]) == (body["id"], False)    # the same pin
    assert pin(server, prompt=SYSTEM, namespace="default").json()["namespace"] == "default"


@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", None),
    ({"prompt": "a", "token_ids": [1]}, "token_ids", None),
    ({"messages": []}, "messages", None),
    ({"token_ids": []}, "token_ids", None),
    ({"token_ids": [10 ** 9]}, "token_ids[0]", "invalid_token_id"),
    ({"token_ids": [5] * 400}, "token_ids", "context_length_exceeded"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt", None),
    ({"prompt": 5}, "prompt", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
])
def test_bad_bodies_are_400(server, body, param, code):
    r = pin(server, **body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert stats(server)["pins"]["pinned_tokens"] == 0


def test_bad_requests_leave_the_server_serving(server):
    assert http.post(server.url + "/cache/pin", body=b"{nope").status == 400
    assert http.post(server.url + "/cache/pin", json={"prompt": "x"},
                     content_type="text/plain").status == 415
    assert http.request("DELETE", server.url + "/cache/pin/pin-0000").status == 404
    assert http.get(server.url + "/cache/pin/x").status in (404, 405)
    assert chat_cached(server, "Hello?") >= 0
