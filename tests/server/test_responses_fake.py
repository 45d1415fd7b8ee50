"""/v1/responses against the fake engine (byte tokenizer, exact control): a follow-up's
prompt is the previous turn's exact ids extended by the new turn (equal to the template's
whole rendering here), GET / DELETE, the stream's OpenAI event types, 404 for unknown,
deleted, lapsed and other-tenant ids, 400 for bad tools and items, the store's budgets
holding against a client that never deletes, and the store surviving a restart on disk."""

from __future__ import annotations

import json

import openai
import pytest

from radixserve.server.auth import AuthConfig
from radixserve.server.conversations import ConversationConfig
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer

KEYS = ("key-a", "key-b")
MAX_RESPONSES = 5


class Clock:
    """Injected time: tests move it instead of sleeping."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def fake():
    config = ServerConfig(port=0, auth=AuthConfig(KEYS),
                          conversations=ConversationConfig(max_responses=MAX_RESPONSES,
                                                           max_tokens=4000, ttl_s=600,
                                                           pin_ttl_s=60))
    with LiveServer(FakeEngine(max_model_len=2048, reply="Sure. "), config) as server:
        clock = Clock()
        server.call(server.state.conversations.set_clock, clock)
        server.clock = clock
        yield server


@pytest.fixture(autouse=True)
def settled(fake):
    yield
    fake.check_invariants()


def client(server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)


def post(server, body: dict, key: str = KEYS[0]) -> http.Reply:
    return http.post(server.base_url + "/responses", json=body,
                     headers={"Authorization": f"Bearer {key}"})


def test_follow_up_extends_the_exact_ids_and_get_delete_work(fake):
    c = client(fake)
    first = c.responses.create(model="fake-model", input="Hello", instructions="Be brief.",
                               max_output_tokens=6)
    assert first.output_text == "[0]Sur" and first.status == "incomplete"
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = c.responses.create(model="fake-model", input="And then?",
                                previous_response_id=first.id, max_output_tokens=6)
    prompt1, prompt2 = fake.engine.calls[-2][0], fake.engine.calls[-1][0]
    reply1 = list("[0]Sur".encode())
    assert prompt2[:len(prompt1) + 6] == prompt1 + reply1   # the exact ids, then the new turn
    render = fake.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "[0]Sur"}, {"role": "user", "content": "And then?"}])
    assert prompt2 == render
    assert second.usage.input_tokens_details.cached_tokens == len(prompt1) + 6 - 1
    assert second.usage.model_extra["radixserve"] == {
        "prompt_source": "extended", "history_tokens": len(prompt1) + 6, "history_pinned": True,
        "cache": None}      # the fake engine explains no miss
    assert c.responses.retrieve(second.id).output_text == second.output_text
    deleted = http.request("DELETE", f"{fake.base_url}/responses/{second.id}",
                           headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert deleted.status == 200 and deleted.json() == {"id": second.id, "object": "response",
                                                        "deleted": True}
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    r = post(fake, {"input": "again", "previous_response_id": second.id})
    assert r.status == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_stream_sends_openai_event_types_and_stores_before_completed(fake):
    c = client(fake)
    events = list(c.responses.create(model="fake-model", input="Hi", max_output_tokens=4,
                                     stream=True, extra_body={"cache_salt": "fresh"}))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[4:8] == ["response.output_text.delta"] * 4
    assert types[8:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events[4:8]) == final.output_text == "[0]S"
    assert final.usage.input_tokens_details.cached_tokens == 0      # written, not omitted
    assert c.responses.retrieve(final.id).output_text == "[0]S"


def test_other_tenant_unknown_and_lapsed_ids_are_404(fake):
    r = client(fake).responses.create(model="fake-model", input="mine", max_output_tokens=2)
    for key in (KEYS[1],):
        other = http.get(f"{fake.base_url}/responses/{r.id}",
                         headers={"Authorization": f"Bearer {key}"})
        assert other.status == 404 and other.json()["error"]["code"] == "response_not_found"
        follow = post(fake, {"input": "x", "previous_response_id": r.id}, key=key)
        assert follow.status == 404
    assert post(fake, {"input": "x", "previous_response_id": "resp_nope"}).status == 404
    fake.clock.now += 601                   # past --response-ttl-s
    lapsed = post(fake, {"input": "x", "previous_response_id": r.id})
    assert lapsed.status == 404 and lapsed.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "messages[0].tool_call_id"),      # answers no earlier call
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "reasoning"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_bodies_are_400_naming_the_field(fake, body, param):
    r = post(fake, body)
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == param


def test_budget_holds_for_a_client_that_never_deletes(fake):
    conv = fake.state.conversations
    previous = None
    pins = []
    for i in range(3 * MAX_RESPONSES):
        body = {"input": f"turn {i}", "max_output_tokens": 3}
        if previous:
            body["previous_response_id"] = previous
        r = post(fake, body)
        assert r.status == 200, r.body
        previous = r.json()["id"]
        held = fake.call(lambda: (len(conv.store), conv.store.stored_tokens,
                                  conv.pins.pinned_tokens))
        assert held[0] <= MAX_RESPONSES and held[1] <= 4000
        assert held[2] <= conv.pins.budget_tokens
        pins.append(fake.call(lambda: len(fake.engine.pinned())))
    assert fake.call(lambda: conv.store.dropped) >= 2 * MAX_RESPONSES
    # one pin per conversation (each turn's replaces the last) until the history outgrows
    # the pin budget (the fake's 256 tokens); then none, and the turns still run
    assert pins[0] == 1 and set(pins) <= {0, 1} and pins[-1] == 0


def test_pin_lapses_after_its_ttl_and_the_follow_up_is_not_refused(fake):
    c = client(fake)
    first = c.responses.create(model="fake-model", input="Remember me", max_output_tokens=3)
    fake.clock.now += 61                    # past --response-pin-ttl-s, within the store's
    second = c.responses.create(model="fake-model", input="Still there?",
                                previous_response_id=first.id, max_output_tokens=3)
    assert second.usage.model_extra["radixserve"]["history_pinned"] is False
    assert second.usage.model_extra["radixserve"]["prompt_source"] == "extended"


def test_store_survives_a_restart_on_disk(tmp_path):
    clock = Clock()
    store = ResponseStore(10, 1000, 60, tmp_path, clock)
    item = StoredResponse(id="resp_1", owner="o", namespace=None, created_at=1, last_used=0,
                          messages=[{"role": "user", "content": "hi"}], reply="yo",
                          token_ids=[1, 2, 3], body={"id": "resp_1"}, pin_id="pin-x")
    store.put(item)
    again = ResponseStore(10, 1000, 60, tmp_path, clock)
    got = again.get("resp_1", "o")
    assert (got.token_ids, got.reply, got.pin_id) == ([1, 2, 3], "yo", None)
    assert json.loads((tmp_path / "resp_1.json").read_text())["token_ids"] == [1, 2, 3]
    again.delete("resp_1", "o")
    assert not (tmp_path / "resp_1.json").exists()
    clock.now += 61
    store.put(StoredResponse(id="resp_2", owner=None, namespace=None, created_at=1,
                             last_used=0, messages=[], reply="", token_ids=[1], body={}))
    clock.now += 61
    assert len(ResponseStore(10, 1000, 60, tmp_path, clock)) == 0      # lapsed while down


def test_prompt_cache_key_is_a_scheduling_hint_never_a_namespace(fake):
    c = client(fake)
    c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "a"}],
                              max_tokens=1, prompt_cache_key="k1")
    c.completions.create(model="fake-model", prompt="b", max_tokens=1,
                         extra_body={"prompt_cache_key": "k2"})
    r = c.responses.create(model="fake-model", input="c", max_output_tokens=1,
                           prompt_cache_key="k3")
    assert r.prompt_cache_key == "k3"
    calls = fake.engine.calls[-3:]
    assert [params.cache_key for _, params, _ in calls] == ["k1", "k2", "k3"]
    assert [namespace for _, _, namespace in calls] == [None, None, None]


def test_a_stored_response_of_another_model_is_re_rendered_not_extended(tmp_path):
    """Stored responses persist beside the KV (--kv-disk-dir) with the model identity their
    ids belong to: after a restart on the same model a follow-up extends the stored ids;
    after a restart on another model it is rendered from the stored items instead."""
    def serve(model: str) -> LiveServer:
        engine = FakeEngine(max_model_len=2048, reply="Sure. ")
        engine.config.kv_disk_dir = str(tmp_path)
        engine.config.model = model
        return LiveServer(engine, ServerConfig(port=0))

    def follow_up(server, previous_id: str) -> dict:
        r = http.post(server.base_url + "/responses", json={
            "input": "Next?", "previous_response_id": previous_id, "max_output_tokens": 2})
        assert r.status == 200, r.body
        return r.json()["usage"]["radixserve"]

    with serve("model-a") as first:
        r = http.post(first.base_url + "/responses", json={"input": "Hi", "max_output_tokens": 2})
        response_id = r.json()["id"]
        first.check_invariants()
    with serve("model-a") as same:
        assert follow_up(same, response_id)["prompt_source"] == "extended"
        same.check_invariants()
    with serve("model-b") as other:
        assert follow_up(other, response_id)["prompt_source"] == "rendered"
        other.check_invariants()
