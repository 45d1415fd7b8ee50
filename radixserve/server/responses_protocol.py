"""OpenAI Responses API schemas (msgspec): the request of `POST /v1/responses` and its
mapping onto a chat request, so it runs through the chat route's own pipeline (messages,
template, ids, engine) and gains whatever that pipeline gains (tool calling)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct, field

from radixserve.server import protocol as P
from radixserve.server.errors import bad_request, unsupported
from radixserve.server.responses_tools import (chat_tool_choice, chat_tools, has_tool_turns,
                                               item_message)

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class InputContent(Struct, kw_only=True):
    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True):
    type: str = "message"
    role: str | None = None
    content: str | list[InputContent] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None          # function_call, function_call_output
    name: str | None = None             # function_call
    arguments: str | None = None        # function_call
    output: str | None = None           # function_call_output

    def message(self, where: str) -> dict[str, str]:
        """The chat message this item stands for (text only)."""
        if self.type != "message":
            raise unsupported(f"{where}.type", f"input items of type {self.type!r} are not "
                                               f"supported (message, function_call, "
                                               f"function_call_output)")
        if self.role not in ROLES:
            raise bad_request(f"{where}.role", f"'role' must be one of {', '.join(ROLES)}")
        if self.content is None:
            raise bad_request(f"{where}.content", "a message item needs 'content'")
        if isinstance(self.content, str):
            text = self.content
        else:
            parts = []
            for i, part in enumerate(self.content):
                if part.type not in TEXT_PARTS:
                    raise unsupported(f"{where}.content[{i}].type",
                                      f"content part type {part.type!r} is not supported "
                                      f"(text only)")
                if part.text is None:
                    raise bad_request(f"{where}.content[{i}].text", "a text part needs 'text'")
                parts.append(part.text)
            text = "".join(parts)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponsesRequest(Struct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: P.PositiveInt | None = None
    temperature: P.Temperature | None = None
    top_p: P.TopP | None = None
    seed: P.Seed | None = None                  # extension (chat's field)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    prompt_cache_key: str | None = None
    cache_salt: str | None = None               # extension: the cache namespace, as on chat
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None

    def check(self) -> None:
        if self.background:
            raise unsupported("background", "'background' responses are not supported")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input", "'input' must not be empty")
        if self.previous_response_id is not None and not self.previous_response_id:
            raise bad_request("previous_response_id", "'previous_response_id' must not be empty")

    def new_messages(self) -> list[dict]:
        """The turn's input as chat messages (function call items: responses_tools.py)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for i, item in enumerate(self.input):
            if item.type in ("function_call", "function_call_output"):
                item_message(item, f"input[{i}]", messages)
            else:
                messages.append(item.message(f"input[{i}]"))
        return messages

    def uses_tools(self, messages: list[dict]) -> bool:
        return bool(self.tools) or has_tool_turns(messages)

    def chat_request(self, messages: list[dict]) -> P.ChatCompletionRequest:
        """The chat request this response runs as (the chat route's checks apply)."""
        return P.ChatCompletionRequest(
            messages=msgspec.convert(messages, list[P.ChatMessage]),
            model=self.model, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            cache_salt=self.cache_salt, user=self.user,
            prompt_cache_key=self.prompt_cache_key,
            tools=chat_tools(self.tools) if self.tools else None,
            tool_choice=chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls)


# ---------------------------------------------------------------- the response object


class OutputText(Struct):
    type: str
    text: str
    annotations: list[Any]


class OutputMessage(Struct):
    type: str
    id: str
    status: str
    role: str
    content: list[OutputText]


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    radixserve: dict[str, Any] | None = None    # extension: how the prompt met the cache


def response_usage(prompt: int, completion: int, cached: int,
                   extension: dict[str, Any] | None = None) -> ResponseUsage:
    return ResponseUsage(prompt, InputTokensDetails(cached), completion, OutputTokensDetails(0),
                         prompt + completion, extension)


class ResponseObject(Struct):
    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[Any]                   # OutputMessage and responses_tools.FunctionCallItem
    usage: ResponseUsage | None
    instructions: str | None
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    prompt_cache_key: str | None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    tools: list[Any] = []
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = False
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"


class DeletedResponse(Struct):
    id: str
    object: str
    deleted: bool
