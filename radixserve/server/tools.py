"""OpenAI tools on the request side: checking `tools`, `tool_choice` and the tool history,
rendering them into the prompt in one canonical order, and the grammar that makes a model
call a tool when it must.

The small API (also for other chat-like routes: /v1/responses, /v1/messages):
- `parse_tools(raw)` -> ToolSet (canonical: sorted by name, schema keys sorted) or a 400;
- `parse_tool_choice(raw, toolset)` -> ToolChoice or a 400;
- `check_history(messages)`: every tool message answers an earlier call (400 otherwise);
- `render_messages(messages, toolset, native)`: messages (and `tools=`) for the chat
  template; `native` says the model's template renders tools itself;
- `call_format(tokenizer)`: the call format the model's family writes (Hermes tags, or
  Llama 3's bare JSON);
- `call_grammar(toolset, choice, parallel, fmt)`: GrammarSpec for `required`, a named tool
  or `auto` (free text, or well-formed calls in that format);
- parsing the output back into calls is `tool_parser.py`'s.

Canonical order: the same tools give the same prompt bytes whatever order the client sent
them in (tools sorted by name; object keys sorted; `required` sorted), so their block is a
prefix-cache hit across requests, processes and restarts.

Families whose template has no tool support get the Hermes/Qwen format (documented in
docs/structured.md): the tool list in the system message inside `<tools></tools>`, calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results as `<tool_response>`.
Llama 3.x templates render tools themselves and ask for a bare JSON object,
`{"name": ..., "parameters": {...}}`, with no tag: for those the grammar asks for that shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.engine.grammar import GrammarSpec, canonical_json
from radixserve.server.errors import bad_request
from radixserve.server.tool_parser import OPEN

HERMES, LLAMA3_JSON = "hermes", "llama3_json"      # call formats (call_format)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

DEFAULT_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict
    strict: bool

    def as_openai(self) -> dict:
        """The canonical OpenAI tool object (what templates and the default block show)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        if self.strict:
            function["strict"] = True
        return json.loads(canonical_json({"type": "function", "function": function}))


@dataclass(frozen=True)
class ToolSet:
    tools: tuple[Tool, ...]             # sorted by name

    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def get(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def as_openai(self) -> list[dict]:
        return [t.as_openai() for t in self.tools]


@dataclass(frozen=True)
class ToolChoice:
    mode: str                           # "auto", "none", "required" or "named"
    name: str | None = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


def parse_tools(raw: list[Any]) -> ToolSet:
    tools: dict[str, Tool] = {}
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise bad_request(f"{where}.type", f"'{where}': each tool must be "
                                               f"{{'type': 'function', ...}}")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function", f"'{where}': a function tool needs a "
                                                   f"'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad_request(f"{where}.function.name", "a tool needs a 'name' of 1-64 characters")
        if name in tools:
            raise bad_request(f"{where}.function.name", f"two tools are named {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters", "'parameters' must be a JSON schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.function.description", "'description' must be a string")
        tools[name] = Tool(name, desc, json.loads(canonical_json(params)),
                           bool(fn.get("strict", False)))
    return ToolSet(tuple(tools[n] for n in sorted(tools)))


def parse_tool_choice(raw: Any, toolset: ToolSet | None) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if raw is None:
        return ToolChoice("auto" if toolset else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' "
                                             "or {'type': 'function', 'function': {'name': ...}}")
        if raw != "none" and not toolset:
            raise bad_request("tool_choice", f"'tool_choice' {raw!r} needs 'tools'")
        return ToolChoice(raw)
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice", "a named 'tool_choice' is {'type': 'function', "
                                         "'function': {'name': ...}}")
    if toolset is None or toolset.get(name) is None:
        raise bad_request("tool_choice", f"'tool_choice' names {name[:64]!r}, which is not in "
                                         f"'tools'")
    return ToolChoice("named", name)


def check_history(messages: list[Any]) -> None:
    """Every `role: "tool"` message answers a call an earlier assistant message made."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for call in getattr(m, "tool_calls", None) or []:
            called.add(call.id)
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}].tool_call_id",
                                  "a 'tool' message needs 'tool_call_id'")
            if m.tool_call_id not in called:
                raise bad_request(f"messages[{i}].tool_call_id",
                                  f"no earlier assistant message made the call "
                                  f"{m.tool_call_id[:64]!r}")


def call_text(name: str, arguments: str) -> str:
    """One call in the default (Hermes) format, arguments canonical."""
    try:
        args = canonical_json(json.loads(arguments)) if arguments else "{}"
    except ValueError:
        args = arguments
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'


def render_messages(messages: list[Any], texts: list[str], toolset: ToolSet | None,
                    native: bool) -> tuple[list[dict], list[dict] | None]:
    """Chat-template input: (messages, tools for `tools=`). `texts` are the messages'
    plain texts; `native`: the template renders tools, calls and results itself."""
    out: list[dict] = []
    for m, text in zip(messages, texts):
        role = "system" if m.role == "developer" else m.role
        calls = getattr(m, "tool_calls", None) or []
        if native:
            d: dict[str, Any] = {"role": role, "content": text}
            if calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in calls]
            if m.role == "tool":
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
            continue
        if calls:
            text = "\n".join([text] * bool(text) + [call_text(c.function.name, c.function.arguments)
                                                     for c in calls])
        if m.role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if not toolset:
        return out, None
    if native:
        return out, toolset.as_openai()
    block = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(canonical_json(t)
                                                        for t in toolset.as_openai()))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_call_format(template: str | None) -> str:
    """The format a chat template's family writes calls in: Llama 3.x templates render the
    tools themselves and ask for `{"name": ..., "parameters": ...}` without a tag (their
    text says "parameters" and none says `<tool_call>`); every other family, and templates
    without tools (the default block), the Hermes tags."""
    if not isinstance(template, str) or "tools" not in template or OPEN in template:
        return HERMES
    return LLAMA3_JSON if '"parameters"' in template else HERMES


def call_format(tokenizer: object) -> str:
    """The served model's call format (`template_call_format` of its chat template)."""
    return template_call_format(getattr(getattr(tokenizer, "hf", None), "chat_template", None))


def call_grammar(toolset: ToolSet, choice: ToolChoice, parallel: bool,
                 fmt: str = HERMES) -> GrammarSpec:
    """Lark: calls of an allowed tool with arguments matching its schema ("name" first, as
    models write it), in the family's format `fmt`: `<tool_call>` blocks (Hermes), or bare
    `{"name": ..., "parameters": ...}` objects separated by "; " (Llama 3). `required` and
    a named tool must call; `auto` may instead write free text (and, with tags, text before
    a call), but any call it starts is well-formed. With `parallel` (not a named tool) up
    to one call per tool: a small model left unbounded may repeat calls until max_tokens."""
    tools = [toolset.get(choice.name)] if choice.mode == "named" else list(toolset.tools)
    args = "parameters" if fmt == LLAMA3_JSON else "arguments"
    options = [{"type": "object", "properties": {
        "name": {"const": t.name}, args: t.parameters},
        "required": ["name", args], "additionalProperties": False} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    body = json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)
    calls = len(tools) if parallel and choice.mode != "named" else 1
    if fmt == LLAMA3_JSON:
        return GrammarSpec("lark", _bare_json_grammar(choice, calls, body))
    repeat = f' ("\\n" call){{0,{calls - 1}}}' if calls > 1 else ""
    if choice.mode == "auto":
        # TEXT: anything without the tag; `pre` (lazy) ends at the tag, which it emits
        start = (f"start: TEXT | pre body_end{repeat}\n"
                 f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
                 f'pre[suffix="<tool_call>\\n"]: /(.|\\n)*/\n'
                 f'body_end: body "\\n</tool_call>"\n')
    else:
        start = f"start: call{repeat}\n"
    lark = (start + f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {body}\n")
    return GrammarSpec("lark", lark)


def _bare_json_grammar(choice: ToolChoice, calls: int, body: str) -> str:
    """Llama 3's calls: the whole output is `;`-separated call objects. `auto` may instead
    write free text that does not start with '{' (after any blank space), so that text
    is never a call cut short."""
    repeat = f' ("; " body){{0,{calls - 1}}}' if calls > 1 else ""
    start = "start: TEXT | calls\nTEXT: /(.|\\n)*/ & ~/\\s*\\{(.|\\n)*/\n" \
        if choice.mode == "auto" else "start: calls\n"
    return start + f"calls: body{repeat}\nbody: %json {body}\n"
