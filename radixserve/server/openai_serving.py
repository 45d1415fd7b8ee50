"""Running a prepared request on the engine, and rendering its outputs as OpenAI responses
or stream chunks; transport-free.

The HTTP handlers (openai_api.py) and the offline batch job both use this module, so a
batch result body is byte-for-byte what the server would have answered. `run_on_engine` is
the one place a request is started and, when its consumer leaves early, aborted.
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar, Protocol

from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.server import protocol as P
from radixserve.server.engine_client import EngineClient, TokenizerClient
from radixserve.server.errors import ApiError
from radixserve.server.miss_report import cache_extension
from radixserve.server.prompts import Prepared
from radixserve.server.tool_parser import (ArgumentsDelta, CallStarted, Event, Text, ToolCall,
                                          ToolCallStream, parse_calls)


# ---------------------------------------------------------------- running on the engine


class Observer(Protocol):
    def on_output(self, out: RequestOutput) -> None: ...


@asynccontextmanager
async def run_on_engine(engine: EngineClient, prepared: Prepared, observer: Observer | None = None,
                        request_id: str | None = None) -> AsyncIterator[AsyncIterator[RequestOutput]]:
    """Start a request and yield its outputs. The engine refuses (InvalidRequest, QueueFull,
    EngineStopped) on entry, before anything is sent; leaving the block before every sample
    finished (client gone, cancellation, an error while writing) aborts the request at once,
    so its pages are released — the server's one abort path."""
    request_id = request_id or uuid.uuid4().hex
    stream = engine.generate(prepared.prompt_ids, prepared.params,
                             namespace=prepared.namespace, request_id=request_id)
    unfinished = prepared.params.n

    async def outputs() -> AsyncIterator[RequestOutput]:
        nonlocal unfinished
        async for out in stream:
            unfinished -= out.finished
            if observer is not None:
                observer.on_output(out)
            yield out

    gen = outputs()
    try:
        yield gen
    finally:
        await gen.aclose()
        if unfinished > 0:
            engine.abort(request_id)
        await stream.aclose()


# ---------------------------------------------------------------- rendering outputs


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    started: bool = False           # streaming: the first chunk (role / echo) went out
    text_offset: int = 0            # completions logprobs: chars emitted so far
    tool_stream: ToolCallStream | None = None   # chat with tools: streamed calls


class Renderer:
    """Accumulates a request's outputs and renders OpenAI bodies. One subclass per API
    (ChatRenderer, CompletionRenderer) renders its own whole responses and chunks; what
    they share (accumulation, usage, errors, logprobs) is here."""

    id_prefix: ClassVar[str]            # of the response id: "chatcmpl-", "cmpl-"
    chunk_type: ClassVar[type]          # the stream chunk's struct
    chunk_object: ClassVar[str]         # its "object" field

    def __init__(self, model: str, prepared: Prepared, tokenizer: TokenizerClient,
                 include_usage: bool = False):
        self.model = model
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(prepared.params.n)]
        self.prompt_tokens = len(prepared.prompt_ids)
        self.cached_tokens = 0
        self.miss = None                # cache.miss_reasons.MissReport of the first sample
        self.wants_logprobs = prepared.params.logprobs is not None
        self.include_usage = include_usage
        self.stopped = False            # sse.EventSource: an error ended the stream

    # -- accumulation

    def add(self, out: RequestOutput) -> ChoiceState:
        c = self.choices[out.index]
        c.text.append(out.text)
        c.num_tokens += len(out.token_ids)
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        if out.finished:
            c.finish_reason = out.finish_reason
            c.stop_reason = out.stop_reason
            if out.usage is not None:
                c.completion_tokens = out.usage.completion_tokens
                self.prompt_tokens = out.usage.prompt_tokens
                self.cached_tokens = max(self.cached_tokens, out.usage.cached_tokens)
                if out.index == 0:
                    self.miss = out.usage.miss
        return c

    def usage(self) -> P.UsageInfo:
        completion = sum(c.completion_tokens if c.completion_tokens is not None else c.num_tokens
                         for c in self.choices)
        extension = cache_extension(self.miss, self.tokenizer)
        return P.usage_info(self.prompt_tokens, completion, self.cached_tokens,
                            None if extension is None else {"cache": extension})

    @staticmethod
    def failure(out: RequestOutput) -> ApiError | None:
        """The error a finished sample reports, if it did not end normally."""
        if out.finish_reason == "error":
            return ApiError(500, f"the request failed inside the engine: {out.error}",
                            type="internal_error", code="engine_error")
        if out.finish_reason == "abort":
            return ApiError(503, "the request was aborted (server shutting down)",
                            type="service_unavailable", code="aborted")
        return None

    # -- sse.EventSource

    def on_output(self, out: RequestOutput) -> list[Any]:
        self.add(out)
        if self.choices[out.index].tool_stream is not None:
            bodies = self._tool_chunks(out)
        else:
            bodies = [chunk] if (chunk := self.chunk(out)) is not None else []
        if out.finished and (err := Renderer.failure(out)) is not None:
            bodies.append(err.body())
            self.stopped = True
        return bodies

    def closing(self) -> list[Any]:
        return [self.usage_chunk()] if self.include_usage else []

    def abort_outputs(self) -> list[RequestOutput]:
        return [RequestOutput("", i, [], "", True, "abort", "aborted by the server")
                for i, c in enumerate(self.choices) if c.finish_reason is None]

    # -- whole responses

    def response(self) -> P.ChatCompletionResponse | P.CompletionResponse:
        raise NotImplementedError

    # -- stream chunks

    def chunk(self, out: RequestOutput):
        """The stream chunk for one output (call after `add`), or None if it says nothing."""
        c = self.choices[out.index]
        first = not c.started
        c.started = True
        finish = out.finish_reason if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        return self._chunk(out, c, first, finish, stop_reason)

    def _chunk(self, out: RequestOutput, c: ChoiceState, first: bool, finish: str | None,
               stop_reason: str | int | None):
        raise NotImplementedError

    # -- chat's messages and tool calls (ChatRenderer's)

    def _chat_choice(self, i: int, c: ChoiceState) -> P.ChatChoice:
        text = "".join(c.text)
        content: str | None = text
        calls: list[ToolCall] = []
        if self.prepared.tools is not None:
            content, calls = parse_calls(text, self.prepared.tools.names)
        message = P.AssistantMessage("assistant", content, [_call_out(t) for t in calls] or None)
        return P.ChatChoice(i, message, self._chat_logprobs(c.logprobs),
                            _finish_reason(c.finish_reason, bool(calls)), c.stop_reason)

    def _tool_chunks(self, out: RequestOutput) -> list[Any]:
        """Chat with tools, streaming: content deltas, and each call as OpenAI streams one (a
        delta with its index, id, type and name, then its arguments fragment by fragment, as
        they are generated), in the order the model wrote them."""
        c = self.choices[out.index]
        first = not c.started
        c.started = True
        assert c.tool_stream is not None
        deltas = _tool_deltas(c.tool_stream.feed(out.text, out.finished))
        if first:
            if deltas and deltas[0].content is not None:
                deltas[0].role = "assistant"
            else:
                deltas.insert(0, P.DeltaMessage(role="assistant", content=""))
        elif not deltas and out.logprobs:
            deltas.append(P.DeltaMessage())
        finish = (_finish_reason(out.finish_reason, bool(c.tool_stream.calls))
                  if out.finished else None)
        if finish is not None:
            deltas.append(P.DeltaMessage())
        chunks = []
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            choice = P.ChatChunkChoice(
                out.index, delta, self._chat_logprobs(out.logprobs) if j == 0 else None,
                finish if last else None, out.stop_reason if (last and out.finished) else None)
            chunks.append(P.ChatCompletionChunk(id=self.id, object="chat.completion.chunk",
                                                created=self.created, model=self.model,
                                                choices=[choice]))
        return chunks

    def usage_chunk(self):
        return self.chunk_type(id=self.id, object=self.chunk_object, created=self.created,
                               model=self.model, choices=[], usage=self.usage())

    # -- logprobs in OpenAI's two shapes

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, items: list[TokenLogprob] | None) -> P.ChatLogprobs | None:
        if not self.wants_logprobs:
            return None
        content = []
        for lp in items or []:
            tok = self._token_str(lp.token_id)
            top = [P.TopLogprob(s, float(v), list(s.encode()))
                   for s, v in ((self._token_str(t), v) for t, v in lp.top)]
            content.append(P.ChatTokenLogprob(tok, float(lp.logprob), list(tok.encode()), top))
        return P.ChatLogprobs(content)

    def _completion_logprobs(self, c: ChoiceState,
                             items: list[TokenLogprob] | None) -> P.CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        out = P.CompletionLogprobs([], [], [], [])
        for lp in items or []:
            tok = self._token_str(lp.token_id)
            out.tokens.append(tok)
            out.token_logprobs.append(float(lp.logprob))
            out.top_logprobs.append({self._token_str(t): float(v) for t, v in lp.top})
            out.text_offset.append(c.text_offset)
            c.text_offset += len(tok)
        return out


class ChatRenderer(Renderer):
    """/v1/chat/completions: assistant messages, tool calls when the request has tools."""

    id_prefix = "chatcmpl-"
    chunk_type = P.ChatCompletionChunk
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, prepared: Prepared, tokenizer: TokenizerClient,
                 include_usage: bool = False):
        super().__init__(model, prepared, tokenizer, include_usage)
        if prepared.tools is not None:
            for c in self.choices:
                c.tool_stream = ToolCallStream(prepared.tools.names)

    def response(self) -> P.ChatCompletionResponse:
        return P.ChatCompletionResponse(
            id=self.id, object="chat.completion", created=self.created, model=self.model,
            choices=[self._chat_choice(i, c) for i, c in enumerate(self.choices)],
            usage=self.usage())

    def _chunk(self, out: RequestOutput, c: ChoiceState, first: bool, finish: str | None,
               stop_reason: str | int | None) -> P.ChatCompletionChunk | None:
        if not (first or out.text or finish or out.logprobs):
            return None
        delta = P.DeltaMessage(role="assistant" if first else None,
                               content=out.text if (out.text or first) else None)
        choice = P.ChatChunkChoice(out.index, delta, self._chat_logprobs(out.logprobs),
                                   finish, stop_reason)
        return P.ChatCompletionChunk(id=self.id, object="chat.completion.chunk",
                                     created=self.created, model=self.model, choices=[choice])


class CompletionRenderer(Renderer):
    """/v1/completions: text choices, the echoed prompt first when asked."""

    id_prefix = "cmpl-"
    chunk_type = P.CompletionChunk
    chunk_object = "text_completion"

    def response(self) -> P.CompletionResponse:
        choices = []
        for i, c in enumerate(self.choices):
            c.text_offset = len(self.prepared.echo_text)
            choices.append(P.CompletionChoice(
                i, self.prepared.echo_text + "".join(c.text),
                self._completion_logprobs(c, c.logprobs), c.finish_reason, c.stop_reason))
        return P.CompletionResponse(id=self.id, object="text_completion", created=self.created,
                                    model=self.model, choices=choices, usage=self.usage())

    def _chunk(self, out: RequestOutput, c: ChoiceState, first: bool, finish: str | None,
               stop_reason: str | int | None) -> P.CompletionChunk | None:
        text = (self.prepared.echo_text if first else "") + out.text
        if first:
            c.text_offset = len(self.prepared.echo_text)
        if not (text or finish or out.logprobs):
            return None
        choice = P.CompletionChoice(out.index, text, self._completion_logprobs(c, out.logprobs),
                                    finish, stop_reason)
        return P.CompletionChunk(id=self.id, object="text_completion", created=self.created,
                                 model=self.model, choices=[choice])


def _tool_deltas(events: list[Event]) -> list[P.DeltaMessage]:
    """A ToolCallStream's events as chat deltas (consecutive text in one)."""
    deltas: list[P.DeltaMessage] = []
    for e in events:
        if isinstance(e, Text):
            if deltas and deltas[-1].content is not None:
                deltas[-1].content += e.text
            else:
                deltas.append(P.DeltaMessage(content=e.text))
        elif isinstance(e, CallStarted):
            deltas.append(P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                e.index, e.id, "function", P.DeltaFunction(e.name, ""))]))
        elif isinstance(e, ArgumentsDelta):
            deltas.append(P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                e.index, function=P.DeltaFunction(arguments=e.text))]))
    return deltas


def _call_out(call: ToolCall) -> P.ToolCallOut:
    return P.ToolCallOut(call.id, "function", P.ToolCallFunction(call.name, call.arguments))


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI ends a turn that called tools with "tool_calls"."""
    return "tool_calls" if made_calls and reason == "stop" else reason


async def run_to_response(engine: EngineClient, renderer: Renderer,
                          observer: Observer | None = None, request_id: str | None = None):
    """Run a prepared request to completion and return its full response body."""
    async with run_on_engine(engine, renderer.prepared, observer, request_id) as outputs:
        async for out in outputs:
            renderer.add(out)
            if out.finished and (err := Renderer.failure(out)) is not None:
                raise err
    return renderer.response()
