"""An Anthropic-compatible `POST /v1/messages`: system, messages, streaming events in
Anthropic's format, and `cache_control` breakpoints kept as TTL pins (cache_breakpoints.py),
with exact `cache_read_input_tokens` / `cache_creation_input_tokens`. Runs as a chat request
through the chat route's pipeline, so the official `anthropic` client works unchanged."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from radixserve.engine.outputs import RequestOutput
from radixserve.server.openapi import RouteDoc, documented
from radixserve.server import cache_breakpoints as B
from radixserve.server.anthropic_protocol import MessagesRequest
from radixserve.server.anthropic_tools import tool_use_block
from radixserve.server.body import expect_continue, read_json
from radixserve.server.engine_client import TokenizerClient
from radixserve.server.miss_report import cache_extension
from radixserve.server.openai_serving import Renderer, run_on_engine
from radixserve.server.prompts import Prepared, prepare_chat
from radixserve.server.sse import NamedEvent, stream_events
from radixserve.server.state import STATE, caller, json_response
from radixserve.server.tool_parser import (ArgumentsDelta, CallDone, CallStarted, Event, Text,
                                          ToolCall, ToolCallStream, parse_calls)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class MessageBuilder:
    """One message's outputs, rendered as Anthropic's body or its stream events.

    With tools, the text goes through a ToolCallStream: a text block opens at the first
    text, each call is a tool_use block (anthropic_tools.py) streamed as it is generated, in
    order."""

    def __init__(self, model: str, prepared: Prepared, placed: list[B.PlacedBreakpoint],
                 tokenizer: TokenizerClient):
        self.id = "msg_" + uuid.uuid4().hex
        self.tokenizer = tokenizer
        self.model = model
        self.prepared = prepared
        self.placed = placed
        self.text: list[str] = []
        self.cached: int | None = None
        self.final: RequestOutput | None = None
        self.started = False
        self.stopped = False            # sse.EventSource
        tools = prepared.tools
        self.tool_stream = ToolCallStream(tools.names) if tools is not None else None
        self.blocks = 0                 # streamed content blocks so far
        self.text_block: int | None = None  # the open text block's index (streaming)
        self.call_blocks: list[int] = []    # each streamed call's block index
        self._content: list[dict[str, Any]] | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        if out.cached_tokens is not None:
            self.cached = out.cached_tokens
        if out.finished:
            self.final = out
            if out.usage is not None:
                self.cached = out.usage.cached_tokens

    def usage(self, output_tokens: int) -> dict[str, Any]:
        split = B.split_usage(len(self.prepared.prompt_ids), self.cached or 0, self.placed)
        return {"input_tokens": split.input_tokens,
                "cache_creation_input_tokens": split.cache_creation_input_tokens,
                "cache_read_input_tokens": split.cache_read_input_tokens,
                "output_tokens": output_tokens,
                "radixserve": {"cache": cache_extension(
                    self.final.usage.miss if self.final and self.final.usage else None,
                    self.tokenizer)}}

    def stop(self) -> tuple[str | None, str | None]:
        final = self.final
        if final is None:
            return None, None
        if isinstance(final.stop_reason, str):
            return "stop_sequence", final.stop_reason
        if final.finish_reason == "stop" and self.made_calls():
            return "tool_use", None
        return STOP_REASONS.get(final.finish_reason or "", "end_turn"), None

    def made_calls(self) -> bool:
        if self.tool_stream is not None and self.started:
            return bool(self.tool_stream.calls)
        return any(b["type"] == "tool_use" for b in self.content())

    def content(self) -> list[dict[str, Any]]:
        """The finished content blocks (made once: tool_use ids are made here)."""
        if self._content is None:
            text = "".join(self.text)
            if self.prepared.tools is None:
                self._content = [{"type": "text", "text": text}]
            else:
                rest, calls = parse_calls(text, self.prepared.tools.names)
                blocks = [{"type": "text", "text": rest}] if rest else []
                self._content = blocks + [tool_use_block(c) for c in calls] or \
                    [{"type": "text", "text": ""}]
        return self._content

    def output_tokens(self) -> int:
        final = self.final
        return final.usage.completion_tokens if final is not None and final.usage else 0

    def message(self, with_stop: bool = True) -> dict[str, Any]:
        reason, sequence = self.stop() if with_stop else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content() if with_stop else [],
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": self.usage(self.output_tokens() if with_stop else 0)}

    def body(self) -> dict[str, Any]:
        return self.message()

    # -- sse.EventSource (outputs are `add`ed by the handler first)

    def on_output(self, out: RequestOutput) -> list[Any]:
        events = []
        if not self.started:
            self.started = True
            events.append(NamedEvent("message_start", {"type": "message_start",
                                                       "message": self.message(False)}))
            if self.tool_stream is None:
                events += self._open_text()
        if self.tool_stream is None:
            if out.text:
                events += self._text_delta(out.text)
        else:
            for event in self.tool_stream.feed(out.text, out.finished):
                if isinstance(event, Text):
                    if self.text_block is None:
                        events += self._open_text()
                    events += self._text_delta(event.text)
                else:
                    events += self._tool_use_events(event)
        if out.finished and (err := Renderer.failure(out)) is not None:
            events.append(NamedEvent("error", {"type": "error", "error": {
                "type": err.type, "message": err.message}}))
            self.stopped = True
        return events

    def _open_text(self) -> list[NamedEvent]:
        self.text_block, self.blocks = self.blocks, self.blocks + 1
        return [NamedEvent("content_block_start", {
            "type": "content_block_start", "index": self.text_block,
            "content_block": {"type": "text", "text": ""}})]

    def _text_delta(self, text: str) -> list[NamedEvent]:
        return [NamedEvent("content_block_delta", {
            "type": "content_block_delta", "index": self.text_block,
            "delta": {"type": "text_delta", "text": text}})]

    def _close_text(self) -> list[NamedEvent]:
        if self.text_block is None:
            return []
        index, self.text_block = self.text_block, None
        return [NamedEvent("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _tool_use_events(self, event: Event) -> list[NamedEvent]:
        """A call as Anthropic streams a tool_use block: started when its name is known,
        its input as `input_json_delta` fragments while it is generated, then stopped."""
        if isinstance(event, CallStarted):
            block = tool_use_block(ToolCall(event.id, event.name, "{}"))
            self.call_blocks.append(self.blocks)
            self.blocks += 1
            return self._close_text() + [NamedEvent("content_block_start", {
                "type": "content_block_start", "index": self.call_blocks[-1],
                "content_block": block})]
        assert isinstance(event, (ArgumentsDelta, CallDone))
        index = self.call_blocks[event.index]
        if isinstance(event, ArgumentsDelta):
            return [NamedEvent("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": event.text}})]
        return [NamedEvent("content_block_stop", {"type": "content_block_stop", "index": index})]

    def closing(self) -> list[Any]:
        reason, sequence = self.stop()
        return self._close_text() + [
            NamedEvent("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": self.usage(self.output_tokens())}),
            NamedEvent("message_stop", {"type": "message_stop"})]

    def abort_outputs(self) -> list[RequestOutput]:
        if self.final is not None:
            return []
        return [RequestOutput("", 0, [], "", True, "abort", "aborted by the server")]


@documented(RouteDoc("Create a message (Anthropic Messages API, cache_control breakpoints); "
                     "server-sent events with stream=true", body=MessagesRequest, response=dict,
                     stream=dict))
async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    conv = state.conversations
    assert conv is not None
    req = await read_json(request, MessagesRequest)
    req.check()
    marks = req.breakpoints()
    prepared = await prepare_chat(req.chat_request(), state.prompts,
                                  caller(request).key_namespace)
    ids = prepared.prompt_ids
    placed = await B.place(req, marks, state.prompts, ids)
    await B.check_budget(conv.breakpoints, placed, ids, prepared.namespace)
    builder = MessageBuilder(state.info.name, prepared, placed, state.engine.tokenizer)
    observer = state.metrics.observer(1)

    async def kept(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        async for out in outputs:
            builder.add(out)
            if out.finished and Renderer.failure(out) is None:
                await B.keep(conv.breakpoints, placed, ids, prepared.namespace)
            yield out

    with state.track() as request_id:
        async with run_on_engine(state.engine, prepared, observer, request_id) as outputs:
            if req.stream:
                return await stream_events(request, kept(outputs), builder,
                                           state.config.sse_keepalive_s,
                                           state.stop_event(request_id))
            async for _ in kept(outputs):
                pass
    if builder.final is not None and (err := Renderer.failure(builder.final)) is not None:
        raise err
    return json_response(builder.body())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message, expect_handler=expect_continue)
