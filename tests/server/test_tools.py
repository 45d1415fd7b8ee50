"""Tool rendering and parsing without a model: canonical order whatever the client sends,
the forced-call grammar, and parsing calls out of whole and streamed text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.server import protocol as P
from radixserve.server.errors import ApiError
from radixserve.server.tool_parser import ToolCallStream, parse_calls
from radixserve.server.tools import (ToolChoice, call_grammar, check_history, parse_tool_choice,
                                     parse_tools, render_messages)

TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool number {i}.",
    "parameters": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                   "required": ["b", "a"]}}} for i in range(6)]


def _shuffled_dict(value, rnd):
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _shuffled_dict(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_shuffled_dict(v, rnd) for v in value]
    return value


def _render(tools, native=False):
    msgs = [P.ChatMessage(role="user", content="hi")]
    return render_messages(msgs, ["hi"], parse_tools(tools), native)


@settings(max_examples=25, deadline=None)
@given(st.randoms(use_true_random=False), st.permutations(TOOLS))
def test_same_tools_render_byte_for_byte_in_any_order(rnd, order):
    reference = _render(TOOLS)
    shuffled = [_shuffled_dict(t, rnd) for t in order]
    for t in shuffled:
        t["function"]["parameters"]["required"] = list(reversed(
            t["function"]["parameters"]["required"]))
    assert json.dumps(_render(shuffled)) == json.dumps(reference)
    assert json.dumps(_render(shuffled, native=True)) == json.dumps(_render(TOOLS, native=True))
    choice = ToolChoice("required")
    assert call_grammar(parse_tools(shuffled), choice, True) == \
        call_grammar(parse_tools(TOOLS), choice, True)


def test_default_rendering_puts_the_block_in_the_system_message():
    messages, tools = _render(TOOLS)
    assert tools is None and messages[0]["role"] == "system"
    assert "<tools>" in messages[0]["content"] and messages[1] == {"role": "user", "content": "hi"}
    messages, tools = _render(TOOLS, native=True)
    assert [t["function"]["name"] for t in tools] == [f"tool_{i}" for i in range(6)]


def test_history_and_choice_checks_name_the_field():
    call = P.ToolCallIn(id="c1", function=P.FunctionCall(name="tool_1", arguments='{"a":"x","b":1}'))
    ok = [P.ChatMessage(role="user", content="q"),
          P.ChatMessage(role="assistant", tool_calls=[call]),
          P.ChatMessage(role="tool", tool_call_id="c1", content="42")]
    check_history(ok)
    bad = ok[:1] + [P.ChatMessage(role="tool", tool_call_id="c1", content="42")]
    try:
        check_history(bad)
        raise AssertionError("no 400")
    except ApiError as e:
        assert e.param == "messages[1].tool_call_id"
    try:
        parse_tool_choice({"type": "function", "function": {"name": "zzz"}}, parse_tools(TOOLS))
        raise AssertionError("no 400")
    except ApiError as e:
        assert e.param == "tool_choice"
    texts = ["q", "", "42"]
    messages, _ = render_messages(ok, texts, parse_tools(TOOLS), native=False)
    assert '<tool_call>\n{"name": "tool_1", "arguments": {"a":"x","b":1}}\n</tool_call>' == \
        messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


NAMES = {"get_weather", "get_time"}
TWO_CALLS = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n'
             '</tool_call>')


def test_parse_hermes_llama3_and_text():
    content, calls = parse_calls(TWO_CALLS, NAMES)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"city": "Tokyo"}
    content, calls = parse_calls('{"name": "get_time", "parameters": {"city": "Oslo"}}', NAMES)
    assert content is None and calls[0].name == "get_time"
    for text in ('{"name": "unknown", "arguments": {}}', "plain words", '<tool_call>{"name": "get_'):
        assert parse_calls(text, NAMES) == (text, [])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60))
def test_streamed_calls_match_the_whole_parse_however_the_text_is_cut(cuts):
    text, pieces, i = TWO_CALLS, [], 0
    for n in cuts:
        pieces.append(text[i:i + n])
        i += n
    pieces.append(text[i:])
    stream = ToolCallStream(NAMES)
    content, calls = "", []
    for p in pieces:
        c, new = stream.push(p)
        content += c
        calls += new
    c, new = stream.finish()
    content, calls = content + c, calls + new
    whole_content, whole_calls = parse_calls(text, NAMES)
    assert content.strip() == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_fifty_tool_required_grammar_compiles_and_accepts_two_calls():
    from radixserve.engine.grammar_cache import GrammarCompiler
    from radixserve.model.tokenizer_loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    tools = [{"type": "function", "function": {"name": f"t{i:02d}", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
        for i in range(50)]
    grammar = GrammarCompiler(tokenizer).compile_blocking(
        call_grammar(parse_tools(tools), ToolChoice("required"), parallel=True))
    matcher = grammar.matcher()
    text = ('<tool_call>\n{"name": "t07", "arguments": {"q": "a"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "t49", "arguments": {"q": "b"}}\n</tool_call>')
    assert all(matcher.accept(t) for t in tokenizer.hf.encode(text, add_special_tokens=False))
    assert matcher.ll.is_accepting()
    matcher.release()
