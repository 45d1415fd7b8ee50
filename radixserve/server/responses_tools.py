"""Function tools on the Responses API, mapped onto the chat tool machinery (tools.py).

- Request tools are flat (`{"type": "function", "name", "description", "parameters",
  "strict"}`); chat's are nested under `function`. A named `tool_choice` is
  `{"type": "function", "name": ...}`.
- Input items `function_call` (a call the model made) and `function_call_output` (its
  result) become an assistant message with `tool_calls` and a `tool` message; consecutive
  calls are one assistant message (parallel calls).
- Output: each parsed call is an output item `{"type": "function_call", "id", "call_id",
  "name", "arguments", "status"}`; a stored response's calls rejoin the history as the
  assistant message that made them, so a follow-up's `function_call_output` answers them.
"""

from __future__ import annotations

import uuid
from typing import Any

from msgspec import Struct

from radixserve.server.errors import bad_request, unsupported
from radixserve.server.tool_parser import ToolCall


class FunctionCallItem(Struct):
    type: str
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


def function_call_item(call: ToolCall, status: str = "completed") -> FunctionCallItem:
    return FunctionCallItem("function_call", "fc_" + uuid.uuid4().hex, call.id, call.name,
                            call.arguments, status)


def chat_tools(raw: list[Any]) -> list[dict]:
    """Responses function tools in chat's shape (tools.parse_tools checks the rest)."""
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise unsupported(f"tools[{i}].type", f"tools of type {kind!r} are not supported "
                                                  f"(function tools only)")
        if "function" in tool:          # chat's nested shape, accepted as well
            out.append(tool)
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(raw: Any) -> Any:
    """`{"type": "function", "name": X}` -> chat's `{"type": "function", "function": {...}}`."""
    if isinstance(raw, dict) and raw.get("type") == "function" and "function" not in raw:
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def call_message(calls: list[dict], content: str | None = None) -> dict:
    """The assistant message that made `calls` ({"call_id", "name", "arguments"} each)."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": c["call_id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}


def item_message(item: Any, where: str, messages: list[dict]) -> None:
    """Append what a `function_call` / `function_call_output` item stands for."""
    if item.type == "function_call":
        for field in ("call_id", "name", "arguments"):
            if not isinstance(getattr(item, field), str) or not getattr(item, field) \
                    and field != "arguments":
                raise bad_request(f"{where}.{field}", f"a function_call item needs '{field}'")
        call = {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                and last.get("content") is None:
            last["tool_calls"].extend(call_message([call])["tool_calls"])
        else:
            messages.append(call_message([call]))
        return
    if not isinstance(item.call_id, str) or not item.call_id:
        raise bad_request(f"{where}.call_id", "a function_call_output item needs 'call_id'")
    if not isinstance(item.output, str):
        raise bad_request(f"{where}.output", "a function_call_output item needs a string "
                                             "'output'")
    messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})


def stored_turn(body: dict, reply: str) -> dict:
    """A stored response's assistant message: its text, and its calls when it made some."""
    calls = [o for o in body.get("output", []) if o.get("type") == "function_call"]
    if not calls:
        return {"role": "assistant", "content": reply}
    texts = [part.get("text", "") for o in body["output"] if o.get("type") == "message"
             for part in o.get("content", [])]
    return call_message(calls, "".join(texts) or None)


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
