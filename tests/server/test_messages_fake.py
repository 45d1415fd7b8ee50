"""POST /v1/messages through the official `anthropic` client, against the fake engine:
the body and stream in Anthropic's shapes, the usage split adding up to the prompt, and the
bad inputs of cache_control (five breakpoints, a bad `ttl`, a pin budget passed) and tools
answered 400 naming the field, and the top-level (automatic) cache_control."""

from __future__ import annotations

import anthropic
import pytest

from radixserve.server.auth import AuthConfig
from radixserve.server.conversations import ConversationConfig
from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer

KEY = "anthropic-key"
SYSTEM = "You answer in one word. " * 4
BREAKPOINT_BUDGET = 200


@pytest.fixture(scope="module")
def fake():
    config = ServerConfig(port=0, auth=AuthConfig((KEY,)), conversations=ConversationConfig(
        cache_control_pin_tokens=BREAKPOINT_BUDGET))
    with LiveServer(FakeEngine(max_model_len=2048, reply="Yes. "), config) as server:
        yield server


@pytest.fixture(autouse=True)
def settled(fake):
    yield
    fake.check_invariants()


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=30)


def system(text: str = SYSTEM, ttl: str | None = None) -> list[dict]:
    control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    return [{"type": "text", "text": text, "cache_control": control}]


def test_message_body_stream_and_usage_split(fake):
    c = client(fake)
    msgs = [{"role": "user", "content": "Sky colour?"}]
    first = c.messages.create(model="fake-model", max_tokens=5, system=system(),
                              messages=msgs)
    assert first.type == "message" and first.role == "assistant"
    assert first.content[0].text == "[0]Ye" and first.stop_reason == "max_tokens"
    u = first.usage
    prompt = len(fake.engine.calls[-1][0])
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == prompt
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > len(SYSTEM)
    with c.messages.stream(model="fake-model", max_tokens=5, system=system(),
                           messages=[{"role": "user", "content": "Grass colour?"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "[0]Ye" == final.content[0].text
    # the system prompt (its breakpoint) was read, the rest computed
    assert final.usage.cache_read_input_tokens >= u.cache_creation_input_tokens - 1
    assert final.usage.cache_creation_input_tokens <= 1


@pytest.mark.parametrize("body, param", [
    ({"system": [{"type": "text", "text": f"s{i}", "cache_control": {"type": "ephemeral"}}
                 for i in range(5)]}, "system[4].cache_control"),
    ({"system": system(ttl="10m")}, "system[0].cache_control.ttl"),
    ({"system": system("x" * (2 * BREAKPOINT_BUDGET))}, "system[0].cache_control"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools[0].type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "messages[0].tool_call_id"),      # answers no earlier tool_use
])
def test_bad_cache_control_and_tools_are_400_naming_the_field(fake, body, param):
    full = {"model": "fake-model", "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}], **body}
    r = http.post(fake.url + "/v1/messages", json=full, headers={"x-api-key": KEY})
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == param
    with pytest.raises(anthropic.BadRequestError):
        client(fake).messages.create(**full)


def test_top_level_cache_control_caches_up_to_the_last_block(fake):
    """Anthropic's automatic caching: a top-level cache_control is a breakpoint at the end
    of the last block, so the first call creates the whole prompt and the same
    conversation, one turn longer, reads all of it."""
    c = client(fake)
    msgs = [{"role": "user", "content": "Q1?"}]
    first = c.messages.create(model="fake-model", max_tokens=3, messages=msgs,
                              extra_body={"cache_control": {"type": "ephemeral"}})
    u = first.usage
    prompt = len(fake.engine.calls[-1][0])
    assert u.cache_read_input_tokens <= 1       # the template's first token: other tests'
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == prompt
    # the byte tokenizer: the whole last block is created, the generation prompt is input
    assert u.cache_creation_input_tokens > len(msgs[0]["content"]) and u.input_tokens > 0
    longer = msgs + [{"role": "assistant", "content": first.content[0].text},
                     {"role": "user", "content": "Q2?"}]
    second = c.messages.create(model="fake-model", max_tokens=3, messages=longer,
                               extra_body={"cache_control": {"type": "ephemeral"}})
    assert second.usage.cache_read_input_tokens >= u.cache_creation_input_tokens - 1
    r = http.post(fake.url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "fake-model", "max_tokens": 3, "messages": msgs,
        "cache_control": {"type": "ephemeral", "ttl": "2h"}})
    assert r.status == 400 and r.json()["error"]["param"] == "cache_control.ttl"
