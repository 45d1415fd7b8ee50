"""Anthropic tools on `/v1/messages`, mapped onto the chat tool machinery (tools.py).

- `tools`: `{"name", "description", "input_schema"}` -> chat's function tools;
  `tool_choice` `auto` / `any` / `tool` (named) / `none` -> chat's `auto` / `required` /
  named / `none`; `disable_parallel_tool_use` -> `parallel_tool_calls: false`.
- History: an assistant's `tool_use` blocks are its `tool_calls`; a user's `tool_result`
  blocks are `tool` messages (before the user's text, as Anthropic orders them).
- Output: each parsed call is a `tool_use` block (`input` is the arguments object) and
  `stop_reason` is `tool_use`; streamed as `content_block_start` + `input_json_delta`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from radixserve.server.errors import bad_request, unsupported
from radixserve.server.tool_parser import ToolCall

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_tools(raw: list[Any]) -> list[dict]:
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}]", "each tool must be an object")
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"tools of type {tool.get('type')!r} are not "
                                                  f"supported (client tools only)")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema", "a tool needs an 'input_schema' "
                                                          "object")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(raw: Any) -> tuple[Any, bool]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if raw is None:
        return None, True
    if not isinstance(raw, dict) or raw.get("type") not in (*CHOICES, "tool"):
        raise bad_request("tool_choice", "'tool_choice' must be {'type': 'auto' | 'any' | "
                                         "'none' | 'tool', ...}")
    parallel = not raw.get("disable_parallel_tool_use", False)
    if raw["type"] == "tool":
        if not isinstance(raw.get("name"), str):
            raise bad_request("tool_choice.name", "a 'tool' tool_choice needs 'name'")
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    return CHOICES[raw["type"]], parallel


def block_messages(role: str, blocks: list[Any], where: str, text_of) -> list[dict]:
    """A message whose blocks hold tool_use / tool_result, as chat messages. `text_of(b, j)`
    is a text block's text (it refuses other types)."""
    calls, results, texts = [], [], []
    for j, b in enumerate(blocks):
        if b.type == "tool_use" and role == "assistant":
            if not isinstance(b.id, str) or not isinstance(b.name, str):
                raise bad_request(f"{where}[{j}]", "a tool_use block needs 'id' and 'name'")
            calls.append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
        elif b.type == "tool_result" and role == "user":
            if not isinstance(b.tool_use_id, str):
                raise bad_request(f"{where}[{j}].tool_use_id",
                                  "a tool_result block needs 'tool_use_id'")
            results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": _result_text(b.content, f"{where}[{j}].content")})
        else:
            texts.append(text_of(b, j))
    text = "".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return results + ([{"role": "user", "content": text}] if text else [])


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise unsupported(where, "tool_result content must be a string or text blocks")


def has_tool_blocks(blocks: Any) -> bool:
    return isinstance(blocks, list) and any(b.type in ("tool_use", "tool_result")
                                            for b in blocks)


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """`input` is {} for arguments that are not a JSON object (a call cut by max_tokens)."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name,
            "input": args if isinstance(args, dict) else {}}
