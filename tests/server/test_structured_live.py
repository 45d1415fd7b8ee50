"""Structured outputs and tools: the official `openai` client, unchanged, against a live
server on SmolLM2 (response_format with a Pydantic model, tool round trips with every
tool_choice, streamed and not, parallel calls; the same round trips on /v1/responses and, with
the `anthropic` client, on /v1/messages), the native route's grammars, and bad input."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from radixserve.engine.grammar import GrammarSpec
from tests.server import http
from tests.server.conftest import MODEL, make_engine
from tests.server.live import LiveServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}, "strict": True}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(loaded_model, tmp_path_factory):
    engine = make_engine(loaded_model,
                         grammar_cache_dir=str(tmp_path_factory.mktemp("grammars")))
    with LiveServer(engine) as srv:
        yield srv


@pytest.fixture()
def client(server):
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.check_invariants()
    assert server.state.prompts.grammars.matchers.live == 0     # every matcher let go


def _args_valid(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=60, temperature=1.0, seed=3)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_completions(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about a cat."}],
        response_format={"type": "json_object"}, max_tokens=30, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    c = client.completions.create(model=MODEL, prompt="Answer in JSON:", max_tokens=20,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema",
                                      "json_schema": {"name": "r", "schema": schema}}})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), schema)


def test_constrained_beside_unconstrained_with_n_seed_logprobs_stop(server, client):
    """One batch: constrained (n=3, seeded, logprobs) and plain requests together; the
    seeded request gives the same outputs twice; logprobs are finite (allowed tokens)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A number, as JSON."}],
            "max_tokens": 20, "temperature": 1.0, "seed": 11, "n": 3, "logprobs": True,
            "top_logprobs": 2, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "n", "schema": schema}}}
    plain = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
             "max_tokens": 20, "temperature": 1.0, "seed": 5}
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(http.post, server.base_url + "/chat/completions", b)
                   for b in (body, plain, body)]
        a, p, b = [f.result().json() for f in futures]
    assert [c["message"]["content"] for c in a["choices"]] == \
        [c["message"]["content"] for c in b["choices"]]
    for choice in a["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        assert all(t["logprob"] > float("-inf") for t in choice["logprobs"]["content"])
    assert p["choices"][0]["message"]["content"]
    # stop strings still apply under a grammar: the output ends before the stop string
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A number, as JSON."}],
        max_tokens=20, temperature=0, stop=[":"],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].message.content == '{"n"' and r.choices[0].finish_reason == "stop"


def _streamed(chunks) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) accumulated from streamed chunks, by tool index."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:               # a call's first delta: id, type, name
                assert tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_round_trip_required_and_auto(client):
    """required (not streamed) -> the tool's answer -> auto (streamed); named, streamed, is
    the next test."""
    tools = [WEATHER, TIME]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=40, temperature=0).choices[0]
    assert first.finish_reason == "tool_calls" and len(first.message.tool_calls) == 1
    call = first.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    _args_valid(call, WEATHER if call.function.name == "get_weather" else TIME)
    history = ASK + [first.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"}]
    content, calls, finish = _streamed(client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, tool_choice="auto", max_tokens=16,
        temperature=0, stream=True))
    if calls:                       # auto: parsed calls, or plain text
        assert finish == "tool_calls" and all(c["name"] in ("get_weather", "get_time")
                                              for c in calls)
    else:
        assert content and finish in ("stop", "length")


def test_streamed_arguments_come_in_fragments_equal_to_the_whole(client):
    """The openai client's own stream accumulation: a named call's arguments arrive as
    several fragments while generated, and join to the non-streamed call's arguments."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=40,
                  temperature=0, tool_choice={"type": "function",
                                              "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    fragments = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    (call,) = final.message.tool_calls
    assert final.finish_reason == "tool_calls" and call.function.name == "get_time"
    assert len(fragments) > 3 and not final.message.content
    assert "".join(fragments) == call.function.arguments == whole.function.arguments
    _args_valid(call, TIME)


def test_parallel_calls_stream_in_openais_delta_format(server):
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
        for name in ("lights_on", "open_door")]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Turn the lights on and "
                                                                    "open the door."}],
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": True,
            "max_tokens": 60, "temperature": 0, "stream": True}
    s = http.SSEStream(server.base_url + "/chat/completions", body)
    deltas = [json.loads(e) for e in s.events() if e != "[DONE]"]
    s.close()
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d["choices"][0]["delta"].get("tool_calls", []):
            if "id" in tc:                      # a call's first delta: id, type, name
                assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "args": ""}
            else:
                calls[tc["index"]]["args"] += tc["function"]["arguments"]
    assert len(calls) == 2 and sorted(calls) == [0, 1]
    assert deltas[-1]["choices"][0]["finish_reason"] == "tool_calls"
    ids = {c["id"] for c in calls.values()}
    assert len(ids) == len(calls)
    for c in calls.values():
        json.loads(c["args"])


def test_native_generate_regex_ebnf_lark_schema(server):
    url = server.url + "/generate"
    cases = [({"regex": "[0-9]{3}-[a-z]{2}"}, r"^[0-9]{3}-[a-z]{2}$"),
             ({"ebnf": 'root ::= "yes" | "no"'}, r"^(yes|no)$"),
             ({"lark": 'start: "A" ("B" | "C")'}, r"^A[BC]$")]
    import re
    for extra, pattern in cases:
        r = http.post(url, {"text": "Answer:", "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 16, **extra}}).json()
        assert re.match(pattern, r["text"]), (extra, r)
        assert r["meta_info"]["finish_reason"] == "stop"
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 2, "maxItems": 2}
    r = http.post(url, {"text": "Two digits:", "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 16, "json_schema": json.dumps(schema)}}).json()
    jsonschema.validate(json.loads(r["text"]), schema)


def test_bad_input_names_the_field(server, client):
    def chat(**kw):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **kw}
        return http.post(server.base_url + "/chat/completions", body)

    r = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}})
    assert r.status == 400 and r.json()["error"]["param"] == "response_format"
    assert "'not'" in r.json()["error"]["message"]
    r = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}})
    assert r.status == 400 and r.json()["error"]["param"] == "response_format"
    r = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status == 400 and r.json()["error"]["param"] == "tool_choice"
    r = chat(tools=[WEATHER], messages=ASK + [{"role": "tool", "tool_call_id": "call_x",
                                               "content": "1"}])
    assert r.status == 400 and r.json()["error"]["param"] == "messages[1].tool_call_id"
    r = chat(response_format={"type": "json_object"}, ignore_eos=True)
    assert r.status == 400 and r.json()["error"]["param"] == "ignore_eos"
    # a grammar that can only end past max_tokens: "length", with what was generated
    r = http.post(server.url + "/generate", {"text": "x", "sampling_params": {
        "regex": "a{20}", "max_new_tokens": 3, "temperature": 0}}).json()
    assert r["meta_info"]["finish_reason"] == "length" and set(r["text"]) == {"a"}
    assert chat().status == 200                 # and the server keeps serving


def test_compile_cap_is_a_400_and_others_keep_running(server, client):
    grammars = server.state.prompts.grammars
    cap = grammars.timeout_s
    grammars.timeout_s = 1e-6
    try:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
        r = http.post(server.base_url + "/chat/completions", {
            "model": MODEL, "messages": ASK, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status == 400 and r.json()["error"]["code"] == "grammar_compile_timeout"
    finally:
        grammars.timeout_s = cap
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices


def test_tools_render_canonically_and_the_tool_block_is_cached(server):
    """Tools sent in another order, keys shuffled: the same prompt tokens; the second
    request finds the whole tool block in the cache."""
    shuffled = [{"function": {k: TIME["function"][k] for k in reversed(list(TIME["function"]))},
                 "type": "function"}, WEATHER]
    bodies = [{"model": MODEL, "messages": ASK, "tools": tools, "max_tokens": 1}
              for tools in ([WEATHER, TIME], shuffled)]
    a, b = [http.post(server.base_url + "/chat/completions", x).json() for x in bodies]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        b["usage"]["prompt_tokens"] - server.engine.page_size - 1


def test_grammar_cache_and_metrics(server):
    grammars = server.state.prompts.grammars
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 3})
    grammars.compile_blocking(spec)
    before = grammars.stats.memory_hits
    grammars.compile_blocking(spec)
    assert grammars.stats.memory_hits == before + 1
    # a fresh compiler on the same directory (a restarted server) validates nothing again
    from radixserve.engine.grammar_cache import GrammarCompiler
    again = GrammarCompiler(server.engine.tokenizer, grammars.cache_dir)
    again.compile_blocking(spec)
    assert again.stats.disk_hits == 1 and again.stats.misses == 0
    again.close()
    # ...and with a prewarm, builds nothing on a request's path: a memory hit
    restarted = GrammarCompiler(server.engine.tokenizer, grammars.cache_dir)
    assert restarted.prewarm(64).result() >= 1
    restarted.compile_blocking(spec)
    assert restarted.stats.memory_hits == 1 and restarted.stats.compiles == 0
    assert restarted.stats.disk_hits == restarted.stats.misses == 0
    restarted.close()
    text = http.get(server.url + "/metrics").text
    for name in ("radixserve_grammar_compile_seconds_total", "radixserve_grammar_cache_hits_total",
                 "radixserve_grammar_cache_misses_total", "radixserve_grammar_mask_seconds_total",
                 "radixserve_grammar_prewarmed_total"):
        assert name in text


def _flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


def test_responses_tool_round_trip_streamed_and_not(client):
    """/v1/responses with the openai client: a forced call comes back as a function_call
    item (not streamed, then streamed through the client's own event accumulation); its
    function_call_output, sent with previous_response_id, gets a text answer."""
    tools = [_flat(WEATHER), _flat(TIME)]
    first = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=tools,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=40, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.call_id.startswith("call_") and call.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.arguments),
                        (WEATHER if call.name == "get_weather" else TIME)["function"]["parameters"])
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=tools, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=8, temperature=0)
    assert [o.type for o in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0     # the history hit
    with client.responses.stream(model=MODEL, input=ASK[0]["content"], tools=tools,
                                 tool_choice={"type": "function", "name": "get_time"},
                                 max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 3     # as generated
    assert "response.function_call_arguments.done" in kinds
    (call,) = [o for o in streamed.output if o.type == "function_call"]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME["function"]["parameters"])
    # the same call, resent as input items (no previous_response_id), is a valid history
    again = client.responses.create(
        model=MODEL, tools=tools, tool_choice="none", max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": ASK[0]["content"]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "noon"}])
    assert again.status in ("completed", "incomplete") and again.output[0].type == "message"


def test_messages_tool_round_trip_streamed_and_not(server):
    """/v1/messages with the anthropic client: tool_choice any -> a tool_use block and
    stop_reason tool_use; its tool_result gets a text answer; a named tool streamed
    through the client's own accumulation of input_json_delta."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url,
                                 api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    ask = [{"role": "user", "content": ASK[0]["content"]}]
    first = client.messages.create(model=MODEL, max_tokens=40, messages=ask,
                                   tools=tools, tool_choice={"type": "any",
                                                             "disable_parallel_tool_use": True})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name in ("get_weather", "get_time")
    jsonschema.validate(use.input, next(t["input_schema"] for t in tools
                                        if t["name"] == use.name))
    answer = client.messages.create(
        model=MODEL, max_tokens=6, tools=tools, tool_choice={"type": "none"},
        messages=ask + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                        {"role": "user", "content": [{"type": "tool_result",
                                                      "tool_use_id": use.id,
                                                      "content": "sunny"}]}])
    assert [b.type for b in answer.content] == ["text"]
    assert answer.usage.cache_read_input_tokens > 0            # the tools block hit
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ask,
                                tools=tools, tool_choice={"type": "tool",
                                                          "name": "get_time"}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds.count("input_json") > 3 and streamed.stop_reason == "tool_use"
    (use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert use.name == "get_time"
    jsonschema.validate(use.input, tools[1]["input_schema"])
    server.check_invariants()
