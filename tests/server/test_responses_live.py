"""The Responses API on the real engine (SmolLM2, fp32) through the official `openai`
client: a 10-turn conversation by `previous_response_id` keeps >= 95% of every follow-up's
prompt cached while other clients' prompts evict around it, because its stored response
pins its tokens; the same conversation with pins off (`--response-pin-ttl-s 0`) is measured
beside it, in the same run, under the same eviction. The official `anthropic` client with
`cache_control` on the system prompt: creation, then a read, then (the TTL passed on the
injected clock, the cache flushed) a creation again. Then a restart with --kv-disk-dir: the
stored response and its KV come back, and the follow-up hits from disk."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from radixserve.server.conversations import ConversationConfig
from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.conftest import MODEL, make_engine
from tests.server.live import LiveServer
from tests.server.test_responses_fake import Clock

POOL = 1536
INSTRUCTIONS = ("You are the itinerary assistant of a small travel agency in Lyon. Answer "
                "in one short sentence, name one place, and never invent prices. ") * 12
TURNS = 10
OTHERS = 8


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def server(loaded_model):
    engine = make_engine(loaded_model, kv_cache_tokens=POOL, max_model_len=768,
                         max_pinned_tokens=700, debug_invariants=True)
    with LiveServer(engine, ServerConfig(port=0)) as srv:
        srv.clock = Clock()
        srv.call(srv.state.conversations.set_clock, srv.clock)
        yield srv


def turn(c: openai.OpenAI, i: int, previous: str | None, salt: str):
    return c.responses.create(model=MODEL, input=f"Stop {i}: where next?",
                              instructions=INSTRUCTIONS if previous is None else None,
                              previous_response_id=previous, max_output_tokens=4,
                              temperature=0, extra_body={"cache_salt": salt})


def set_pins(server, on: bool) -> None:
    pins = server.state.conversations.pins
    server.call(setattr, pins, "ttl_s", ConversationConfig().pin_ttl_s if on else 0.0)


def other_clients(server, rng: random.Random) -> None:
    """Eight other clients at once, each a prompt of 100 fresh token ids: with the two
    conversations they overflow the pool, so LRU evicts what is not pinned."""
    c = client(server)
    prompts = [[rng.randrange(1000, 40000) for _ in range(100)] for _ in range(OTHERS)]
    with ThreadPoolExecutor(OTHERS) as pool:
        list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=1,
                                                     temperature=0), prompts))


def test_ten_turns_stay_cached_with_pins_and_not_without(server):
    c = client(server)
    rng = random.Random(0)
    ratios: dict[str, list[float]] = {"pinned": [], "unpinned": []}
    previous: dict[str, str | None] = {"pinned": None, "unpinned": None}
    for i in range(TURNS):
        for name in ("pinned", "unpinned"):
            set_pins(server, name == "pinned")
            r = turn(c, i, previous[name], name)
            previous[name] = r.id
            u = r.usage
            ratios[name].append(u.input_tokens_details.cached_tokens / u.input_tokens)
            if i:
                assert u.model_extra["radixserve"]["prompt_source"] == "extended"
        set_pins(server, True)
        other_clients(server, rng)
    print("cached/prompt by turn:", {k: [round(x, 3) for x in v] for k, v in ratios.items()})
    assert ratios["pinned"][0] == 0.0
    assert min(ratios["pinned"][1:]) >= 0.95
    # without a pin, LRU trims the history's tail between turns: each follow-up recomputes it
    assert max(ratios["unpinned"][3:]) < 0.9
    server.check_invariants()


def test_stored_response_and_its_kv_survive_a_restart(loaded_model, tmp_path):
    def start():
        engine = make_engine(loaded_model, kv_cache_tokens=2048, max_model_len=768,
                             kv_disk_dir=str(tmp_path), debug_invariants=True)
        return LiveServer(engine, ServerConfig(port=0))

    with start() as srv:
        first = turn(client(srv), 0, None, "restart")
        srv.check_invariants()
    with start() as srv:
        c = client(srv)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        second = turn(c, 1, first.id, "restart")
        history = second.usage.model_extra["radixserve"]["history_tokens"]
        assert second.usage.input_tokens_details.cached_tokens >= history - 4
        srv.check_invariants()


def test_anthropic_cache_control_creation_read_and_creation_after_the_ttl(server):
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    system = [{"type": "text", "text": "You are the concierge of a quiet hotel in Annecy. " * 8,
               "cache_control": {"type": "ephemeral", "ttl": "5m"}}]

    def ask(question: str, marked: bool = True):
        text = system if marked else [{"type": "text", "text": system[0]["text"]}]
        r = c.messages.create(model=MODEL, max_tokens=2, system=text,
                              messages=[{"role": "user", "content": question}])
        u = r.usage
        assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens \
            == server.call(lambda: server.engine.stats().prompt_tokens) - before[0]
        before[0] += u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
        return u

    before = [server.call(lambda: server.engine.stats().prompt_tokens)]
    first = ask("Is breakfast served?")
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 80
    second = ask("Is there parking?")
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    server.clock.now += 301                         # past the 5m TTL: the pin lapses
    # (released at the next /v1/messages call; this one does not mark it, so does not renew
    # it): the prefix is still cached, now evictable...
    assert ask("Late checkout?", marked=False).cache_read_input_tokens > 0
    assert http.post(server.url + "/cache/flush", json={}).status == 200   # ...and evicted
    third = ask("Is breakfast served?")
    assert third.cache_read_input_tokens == 0
    assert third.cache_creation_input_tokens == first.cache_creation_input_tokens
    server.check_invariants()


def test_a_template_bug_deep_in_the_history_is_named_with_its_position_and_tokens(server):
    """Two chat requests whose rendered histories differ in one token deep inside (a
    template that rewrites an earlier reply: 'Sure.' against 'Sure!'): the second's miss
    reason is a divergence at that token, with both sides decoded."""
    c = client(server)
    history = [{"role": "system", "content": INSTRUCTIONS},
               {"role": "user", "content": "Can you plan a day in Lyon?"},
               {"role": "assistant", "content": "Sure. Start at Fourviere, then the old town."},
               {"role": "user", "content": "And the evening?"}]
    bugged = [dict(m) for m in history]
    bugged[2]["content"] = bugged[2]["content"].replace("Sure.", "Sure!")

    def ask(messages):
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                      temperature=0, extra_body={"cache_salt": "template"})
        return r.usage

    first = ask(history)
    # (the instructions are cached under the conversation tests' salts: same tenant)
    assert first.model_extra["radixserve"]["cache"]["reason"] in (
        "never_seen", "diverged", "other_namespace")
    second = ask(bugged)
    report = second.model_extra["radixserve"]["cache"]
    assert report["reason"] == "diverged"
    d = report["divergence"]
    ids = server.engine.tokenizer.apply_chat_template(bugged)
    assert d["position"] == report["matched_tokens"] == second.prompt_tokens_details.cached_tokens
    assert d["position"] > len(server.engine.tokenizer.apply_chat_template(history[:2])) - 8
    at = d["position"] - d["start"]
    assert d["prompt_token_ids"][at] == ids[d["position"]] != d["cached_token_ids"][at]
    assert d["prompt"][at] == "!" and d["cached"][at] == "."
    server.check_invariants()
