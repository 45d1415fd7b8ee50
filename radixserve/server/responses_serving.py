"""One response of the Responses API: its outputs accumulated into the response object, and
its stream in OpenAI's event types (`response.created` ... `response.completed`), each
written as `event: <type>` + `data: {...}` with a `sequence_number`."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from radixserve.engine.outputs import RequestOutput
from radixserve.server.conversations import TurnPrompt
from radixserve.server.engine_client import TokenizerClient
from radixserve.server.errors import ApiError
from radixserve.server.miss_report import cache_extension
from radixserve.server.openai_serving import Renderer
from radixserve.server.responses_protocol import (OutputMessage, OutputText, ResponseObject,
                                                  ResponsesRequest, response_usage)
from radixserve.server.responses_tools import FunctionCallItem, function_call_item
from radixserve.server.sse import NamedEvent
from radixserve.server.tool_parser import (ArgumentsDelta, CallDone, CallStarted, Event, Text,
                                          ToolCall, ToolCallStream, parse_calls)


class ResponseBuilder:
    """Accumulates one response's outputs (n is 1) and renders its object and events.

    Without tools the output is one message, opened with the stream. With tools, the text
    goes through a ToolCallStream: the message item opens at the first text, and each call
    is a `function_call` item streamed as it is generated, output indexes in order of
    appearance."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest, turn: TurnPrompt,
                 tokenizer: TokenizerClient):
        self.id = response_id
        self.tokenizer = tokenizer
        self.model = model
        self.req = req
        self.turn = turn
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.final: RequestOutput | None = None
        self.sequence = 0
        self.stopped = False            # sse.EventSource: an error ended the stream
        tools = turn.prepared.tools
        self.tool_stream = ToolCallStream(tools.names) if tools is not None else None
        self.message_index: int | None = None   # the message's output index, once opened
        self.content_deltas: list[str] = []     # with tools: the text that is not a call
        self._parsed: list[Any] | None = None   # with tools, not streamed: the output items
        self.streamed_calls: list[FunctionCallItem] = []
        self.call_places: list[int] = []        # each streamed call's output index

    # -- accumulation

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.finished:
            self.final = out

    @property
    def reply(self) -> str:
        return "".join(self.text)

    def failure(self) -> ApiError | None:
        return Renderer.failure(self.final) if self.final is not None else None

    # -- the response object

    def extension(self) -> dict[str, Any]:
        """usage.radixserve: how this prompt met the cache."""
        turn = self.turn
        previous = turn.previous
        usage = self.final.usage if self.final is not None else None
        return {"prompt_source": turn.source,
                "history_tokens": len(previous.token_ids) if previous is not None else 0,
                "history_pinned": turn.history_pinned,
                "cache": cache_extension(usage.miss if usage else None, self.tokenizer)}

    def response(self, status: str | None = None) -> ResponseObject:
        final = self.final
        if status is None:
            status = "incomplete" if final is not None and final.finish_reason == "length" \
                else "completed"
        done = final is not None
        output = self._output() if done else []
        usage = None
        if done and final.usage is not None:
            u = final.usage
            usage = response_usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                                   self.extension())
        req = self.req
        return ResponseObject(
            id=self.id, object="response", created_at=self.created_at, status=status,
            model=self.model, output=output, usage=usage, instructions=req.instructions,
            previous_response_id=req.previous_response_id, store=req.store,
            temperature=req.temperature, top_p=req.top_p,
            max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            prompt_cache_key=req.prompt_cache_key,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            tools=list(req.tools or []), tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls)

    def _message(self, text: str, status: str = "completed") -> OutputMessage:
        content = [OutputText("output_text", text, [])] if status == "completed" else []
        return OutputMessage("message", self.message_id, status, "assistant", content)

    def _output(self) -> list[Any]:
        """The finished output items: the message, and with tools the calls it holds."""
        if self.turn.prepared.tools is None:
            return [self._message(self.reply)]
        if self.streamed_calls or self.message_index is not None:
            items: list[Any] = list(self.streamed_calls)
            if self.message_index is not None:
                items.insert(self.message_index, self._message(self._content_text()))
            return items
        if self._parsed is None:        # once: call ids are made here
            content, calls = parse_calls(self.reply, self.turn.prepared.tools.names)
            items = [self._message(content)] if content else []
            self._parsed = items + [function_call_item(c) for c in calls] or [self._message("")]
        return self._parsed

    def _content_text(self) -> str:
        return "".join(self.content_deltas)

    def body(self) -> dict:
        return msgspec.to_builtins(self.response())

    # -- sse.EventSource

    def _event(self, type: str, **fields: Any) -> NamedEvent:
        self.sequence += 1
        return NamedEvent(type, {"type": type, "sequence_number": self.sequence - 1, **fields})

    def opening(self) -> list[NamedEvent]:
        empty = self.response("in_progress")
        events = [self._event("response.created", response=empty),
                  self._event("response.in_progress", response=empty)]
        if self.tool_stream is None:
            events += self._open_message()
        return events

    def _open_message(self) -> list[NamedEvent]:
        self.message_index = len(self.streamed_calls)
        part = OutputText("output_text", "", [])
        return [self._event("response.output_item.added", output_index=self.message_index,
                            item=self._message("", "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id,
                            output_index=self.message_index, content_index=0, part=part)]

    def _text_delta(self, text: str) -> list[NamedEvent]:
        events = []
        if self.message_index is None:
            events += self._open_message()
        self.content_deltas.append(text)
        events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                  output_index=self.message_index, content_index=0,
                                  delta=text, logprobs=[]))
        return events

    def _call_events(self, event: Event) -> list[NamedEvent]:
        """A call as OpenAI streams a function_call item: added when its name is known, its
        arguments fragment by fragment, then done."""
        if isinstance(event, CallStarted):
            index = len(self.streamed_calls) + (self.message_index is not None)
            item = function_call_item(ToolCall(event.id, event.name, ""), "in_progress")
            self.streamed_calls.append(item)
            self.call_places.append(index)
            return [self._event("response.output_item.added", output_index=index, item=item)]
        assert isinstance(event, (ArgumentsDelta, CallDone))
        index, item = self.call_places[event.index], self.streamed_calls[event.index]
        if isinstance(event, ArgumentsDelta):
            return [self._event("response.function_call_arguments.delta", item_id=item.id,
                                output_index=index, delta=event.text)]
        done = FunctionCallItem(item.type, item.id, item.call_id, item.name,
                                event.call.arguments, "completed")
        self.streamed_calls[event.index] = done
        return [self._event("response.function_call_arguments.done", item_id=item.id,
                            output_index=index, arguments=done.arguments),
                self._event("response.output_item.done", output_index=index, item=done)]

    def on_output(self, out: RequestOutput) -> list[Any]:
        """Events for an output already `add`ed (the handler adds, and stores the finished
        response, before the stream renders it)."""
        first = self.sequence == 0
        events = self.opening() if first else []
        if self.tool_stream is None:
            if out.text:
                events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                          output_index=0, content_index=0, delta=out.text,
                                          logprobs=[]))
        else:
            for event in self.tool_stream.feed(out.text, out.finished):
                events += (self._text_delta(event.text) if isinstance(event, Text)
                           else self._call_events(event))
        if out.finished and (err := self.failure()) is not None:
            events.append(self._event("error", code=err.code, message=err.message,
                                      param=None))
            self.stopped = True
        return events

    def closing(self) -> list[Any]:
        """The done events and `response.completed` (the caller stored the response)."""
        whole = self.response()
        events = []
        if self.message_index is not None:
            text = self.reply if self.tool_stream is None else self._content_text()
            part = OutputText("output_text", text, [])
            index = self.message_index
            events = [self._event("response.output_text.done", item_id=self.message_id,
                                  output_index=index, content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=self.message_id,
                                  output_index=index, content_index=0, part=part),
                      self._event("response.output_item.done", output_index=index,
                                  item=whole.output[index])]
        return events + [self._event("response.completed" if whole.status == "completed"
                                     else "response.incomplete", response=whole)]

    def abort_outputs(self) -> list[RequestOutput]:
        if self.final is not None:
            return []
        return [RequestOutput("", 0, [], "", True, "abort", "aborted by the server")]
