"""Tool rendering and parsing without a model: canonical order whatever the client sends,
the forced-call grammar, and parsing calls out of whole and streamed text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.server import protocol as P
from radixserve.server.errors import ApiError
from radixserve.server.tool_parser import (ArgumentsDelta, CallDone, CallStarted, Text,
                                          ToolCallStream, parse_calls)
from radixserve.server.tools import (HERMES, LLAMA3_JSON, ToolChoice, call_grammar,
                                     check_history, parse_tool_choice, parse_tools,
                                     render_messages, template_call_format)

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


def test_llama3_calls_split_on_semicolons_between_objects_only():
    """Several bare calls are `;`-separated; a ';' inside an argument is no separator, and
    anything after the last object that is not another call makes the output text (a
    trailing ';' is forgiven)."""
    two = ('{"name": "get_time", "parameters": {"city": "Oslo; Norway"}}; '
           '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    content, calls = parse_calls(two, NAMES)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo; Norway"}
    assert [c.name for c in parse_calls(two + ";", NAMES)[1]] == ["get_time", "get_weather"]
    for text in (two + " and more", '{"name": "get_time", "parameters": {"c'):
        assert parse_calls(text, NAMES) == (text, [])


def _replay(pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Content and calls (id, name, argument fragments) accumulated from a stream's events,
    checking their order: started, then fragments, then done with the joined arguments."""
    stream, content, calls = ToolCallStream(NAMES), "", {}
    events = [e for p in pieces for e in stream.push(p)] + stream.finish()
    for e in events:
        if isinstance(e, Text):
            content += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls)
            calls[e.index] = {"id": e.id, "name": e.name, "fragments": [], "done": False}
        elif isinstance(e, ArgumentsDelta):
            assert not calls[e.index]["done"] and e.text
            calls[e.index]["fragments"].append(e.text)
        else:
            assert isinstance(e, CallDone) and e.call.id == calls[e.index]["id"]
            assert e.call.arguments == "".join(calls[e.index]["fragments"])
            calls[e.index]["done"] = True
    assert all(c["done"] for c in calls.values())
    return content, calls


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60))
def test_streamed_calls_match_the_whole_parse_however_the_text_is_cut(cuts):
    text, pieces, i = TWO_CALLS, [], 0
    for n in cuts:
        pieces.append(text[i:i + n])
        i += n
    pieces.append(text[i:])
    content, calls = _replay(pieces)
    whole_content, whole_calls = parse_calls(text, NAMES)
    assert content.strip() == whole_content
    assert [(c["name"], "".join(c["fragments"])) for c in calls.values()] == \
        [(c.name, c.arguments) for c in whole_calls]


def test_arguments_stream_as_generated_and_equal_the_whole_parse():
    """One piece a character: every call starts once its name is read, its arguments
    come as they arrive (a brace inside a string does not end them), exactly as written."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", '
            '"days": [1, {"x": 2}]}}\n</tool_call>')
    content, calls = _replay(list(text))
    args = '{"city": "Pa}r\\"is", "days": [1, {"x": 2}]}'
    assert not content and len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert len(calls[0]["fragments"]) == len(args) and "".join(calls[0]["fragments"]) == args
    assert parse_calls(text, NAMES)[1][0].arguments == args
    # a call cut short (max_tokens) ends with what it has, streamed or not
    at = text.index(args)
    assert [c.arguments for c in parse_calls(text[:at + 9], NAMES)[1]] == [args[:9]]
    # unknown names and other key orders are parsed whole when the block closes
    other = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_time"}</tool_call>'
    content, calls = _replay(list(other + " ok"))
    assert content.strip() == "ok" and "".join(calls[0]["fragments"]) == '{"city": "Oslo"}'
    unknown = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert _replay(list(unknown)) == (unknown, {})


@pytest.fixture(scope="module")
def compiler():
    from radixserve.engine.grammar_cache import GrammarCompiler
    from radixserve.model.tokenizer_loader import load_tokenizer
    compiler = GrammarCompiler(load_tokenizer("smollm2-135m-instruct"))
    yield compiler
    compiler.close()


FIFTY = [{"type": "function", "function": {"name": f"t{i:02d}", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    for i in range(50)]
TWO_OF_FIFTY = ('<tool_call>\n{"name": "t07", "arguments": {"q": "a"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "t49", "arguments": {"q": "b"}}\n</tool_call>')


def _accepts(compiler, spec, text: str) -> bool:
    """The grammar takes `text` whole and may end there; its matcher let go after."""
    matcher = compiler.compile_blocking(spec).matcher()
    try:
        ids = compiler.tokenizer.hf.encode(text, add_special_tokens=False)
        return all(matcher.accept(t) for t in ids) and matcher.ll.is_accepting()
    finally:
        matcher.release()


def test_fifty_tool_required_grammar_compiles_and_accepts_two_calls(compiler):
    spec = call_grammar(parse_tools(FIFTY), ToolChoice("required"), parallel=True)
    assert _accepts(compiler, spec, TWO_OF_FIFTY)
    assert not _accepts(compiler, spec, "Sure, no call.")


def test_auto_grammar_allows_text_or_well_formed_calls(compiler):
    """tool_choice auto is constrained: free text, text then calls, or calls; never a
    malformed call or one of an unknown tool."""
    tools = parse_tools(FIFTY)
    auto = call_grammar(tools, ToolChoice("auto"), parallel=True)
    assert _accepts(compiler, auto, "There is no need for a tool here. a < b > c.")
    assert _accepts(compiler, auto, TWO_OF_FIFTY)
    assert _accepts(compiler, auto, "Let me look.\n" + TWO_OF_FIFTY)
    for bad in ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "t07", "arguments": {"x": 1}}\n</tool_call>',
                '<tool_call>\n{"name": "t07"}\n</tool_call>'):
        assert not _accepts(compiler, auto, bad)
    single = call_grammar(tools, ToolChoice("auto"), parallel=False)
    assert not _accepts(compiler, single, TWO_OF_FIFTY)


def test_auto_with_a_schema_the_library_refuses(compiler):
    """auto leaves the output free (parsed) when a non-strict tool's schema is refused, as
    OpenAI accepts any schema there; a strict tool makes the refusal a 400 naming tools."""
    import asyncio

    from radixserve.server.structured import auto_call_grammar
    tool = {"type": "function", "function": {"name": "tags", "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}
    loose = parse_tools([tool])
    assert asyncio.run(auto_call_grammar(compiler, loose, ToolChoice("auto"), False)) is None
    strict = parse_tools([{**tool, "function": {**tool["function"], "strict": True}}])
    try:
        asyncio.run(auto_call_grammar(compiler, strict, ToolChoice("auto"), False))
    except ApiError as exc:
        assert exc.status == 400 and exc.param == "tools" and "uniqueItems" in exc.message
    else:
        raise AssertionError("a strict tool's refused schema must be a 400")
    ok = asyncio.run(auto_call_grammar(compiler, parse_tools(FIFTY[:2]), ToolChoice("auto"),
                                       False))
    assert ok is not None


# The tool part of Llama 3.1/3.2's template, in Meta's words: the tools in the first user
# message, calls asked for as bare JSON (no tag), earlier calls rendered back that way.
LLAMA3_TEMPLATE = (
    "{%- for m in messages %}<s>{{ m['role'] }}: "
    "{%- if m['role'] == 'user' and loop.first and tools is defined and tools %}"
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n"
    "{%- for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}"
    "{%- if m.get('tool_calls') %}{%- for c in m['tool_calls'] %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{%- else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{%- if add_generation_prompt %}<s>assistant: {% endif %}")


def test_the_template_family_picks_the_call_format():
    from tests.model.tiny_models import CHAT_TEMPLATE
    assert template_call_format(LLAMA3_TEMPLATE) == LLAMA3_JSON
    assert template_call_format(CHAT_TEMPLATE) == HERMES            # no tools: default block
    assert template_call_format(None) == HERMES
    hermes = "{% if tools %}<tools>{{ tools }}</tools> use <tool_call>{\"name\": ...}{% endif %}"
    assert template_call_format(hermes) == HERMES


def test_auto_grammar_in_llama3_format_allows_text_or_bare_json_calls(compiler):
    """Llama 3's auto: free text, or the whole output one or more bare `{"name": ...,
    "parameters": ...}` calls; text that starts with '{' must be a well-formed call."""
    tools = parse_tools(FIFTY)
    auto = call_grammar(tools, ToolChoice("auto"), parallel=True, fmt=LLAMA3_JSON)
    one = '{"name": "t07", "parameters": {"q": "a"}}'
    assert _accepts(compiler, auto, "No tool is needed: {braces} are fine inside text.")
    assert _accepts(compiler, auto, one)
    assert _accepts(compiler, auto, one + '; {"name": "t49", "parameters": {"q": "b"}}')
    for bad in ('{"name": "nope", "parameters": {}}', '{"name": "t07", "arguments": {"q": "a"}}',
                '{"name": "t07", "parameters": {"x": 1}}', "{not json at all",
                "  " + one[:-1]):       # a call cut short may not end the output
        assert not _accepts(compiler, auto, bad)
    single = call_grammar(tools, ToolChoice("auto"), parallel=False, fmt=LLAMA3_JSON)
    assert not _accepts(compiler, single, one + '; ' + one)
    required = call_grammar(tools, ToolChoice("required"), parallel=False, fmt=LLAMA3_JSON)
    assert _accepts(compiler, required, one)
    assert not _accepts(compiler, required, "Sure, no call.")
