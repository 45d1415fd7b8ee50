"""Anthropic Messages API schemas (msgspec) for `POST /v1/messages`, and their mapping onto a
chat request, so a message runs through the chat route's pipeline (template, ids, engine).

`cache_control` breakpoints are collected with the JSON path of their block, so that an
error (five breakpoints, a bad `ttl`) names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import Struct

from radixserve.server import protocol as P
from radixserve.server.anthropic_tools import (block_messages, chat_tool_choice, chat_tools,
                                               has_tool_blocks)
from radixserve.server.errors import bad_request, unsupported

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(Struct, kw_only=True):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(Struct, kw_only=True):
    """A content block: text, or (anthropic_tools.py) tool_use / tool_result."""

    type: str
    text: str | None = None
    cache_control: CacheControl | None = None
    id: str | None = None                       # tool_use
    name: str | None = None                     # tool_use
    input: dict[str, Any] | None = None         # tool_use
    tool_use_id: str | None = None              # tool_result
    content: str | list[dict[str, Any]] | None = None   # tool_result
    is_error: bool | None = None                # tool_result


class Message(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


@dataclass(frozen=True)
class Breakpoint:
    """A `cache_control` mark: the prompt up to the end of `block` of `message` (message -1:
    the system prompt) is kept cached for `ttl_s`."""

    path: str                   # e.g. "system[0].cache_control"
    message: int
    block: int
    ttl_s: float


class MessagesRequest(Struct, kw_only=True):
    model: str | None = None
    max_tokens: P.PositiveInt
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    stream: bool = False
    temperature: P.Temperature | None = None
    top_p: P.TopP | None = None
    top_k: P.TopK | None = None
    stop_sequences: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    metadata: dict[str, Any] | None = None
    cache_control: CacheControl | None = None   # automatic: a breakpoint on the last block

    def check(self) -> None:
        if not self.messages:
            raise bad_request("messages", "'messages' must contain at least one message")

    def breakpoints(self) -> list[Breakpoint]:
        found = []
        blocks = [(-1, self.system, "system")] + [(i, m.content, f"messages[{i}].content")
                                                  for i, m in enumerate(self.messages)]
        for index, content, where in blocks:
            if isinstance(content, list):
                for j, block in enumerate(content):
                    if block.cache_control is not None:
                        found.append(Breakpoint(f"{where}[{j}].cache_control", index, j,
                                                TTL_SECONDS[block.cache_control.ttl]))
        if self.cache_control is not None:
            last = self._last_block()
            if all((b.message, b.block) != last for b in found):
                found.append(Breakpoint("cache_control", *last,
                                        TTL_SECONDS[self.cache_control.ttl]))
        if len(found) > MAX_BREAKPOINTS:
            raise bad_request(found[MAX_BREAKPOINTS].path,
                              f"at most {MAX_BREAKPOINTS} blocks may have 'cache_control' "
                              f"(this request has {len(found)})", "too_many_breakpoints")
        return found

    def _last_block(self) -> tuple[int, int]:
        """(message, block) of the request's last block, where Anthropic's automatic
        caching puts the breakpoint (the whole prompt up to the new turn's end)."""
        i = len(self.messages) - 1
        content = self.messages[i].content
        return i, (len(content) - 1 if isinstance(content, list) and content else 0)

    def chat_messages(self, upto: Breakpoint | None = None) -> list[dict]:
        """The conversation as chat messages; with `upto`, cut after that block (what a
        breakpoint caches)."""
        out = []
        if self.system is not None:
            out.append({"role": "system", "content": _text(self.system, "system", upto, -1)})
        if upto is not None and upto.message == -1:
            return out
        for i, m in enumerate(self.messages):
            where = f"messages[{i}].content"
            if has_tool_blocks(m.content):
                out += block_messages(m.role, m.content, where,
                                      lambda b, j, w=where: _block_text(b, f"{w}[{j}]"))
            else:
                out.append({"role": m.role, "content": _text(m.content, where, upto, i)})
            if upto is not None and upto.message == i:
                break
        return out

    def chat_request(self) -> P.ChatCompletionRequest:
        choice, parallel = chat_tool_choice(self.tool_choice)
        return P.ChatCompletionRequest(
            messages=msgspec.convert(self.chat_messages(), list[P.ChatMessage]),
            model=self.model, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences,
            tools=chat_tools(self.tools) if self.tools else None, tool_choice=choice,
            parallel_tool_calls=parallel)


def _block_text(block: TextBlock, where: str) -> str:
    if block.type != "text":
        raise unsupported(f"{where}.type", f"content blocks of type {block.type!r} are not "
                                           f"supported here (text; tool_use in assistant "
                                           f"messages, tool_result in user messages)")
    if block.text is None:
        raise bad_request(f"{where}.text", "a text block needs 'text'")
    return block.text


def _text(content: str | list[TextBlock], where: str, upto: Breakpoint | None,
          index: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        parts.append(_block_text(block, f"{where}[{j}]"))
        if upto is not None and upto.message == index and upto.block == j:
            break
    return "".join(parts)
