"""OpenAI request handling without a transport: prompt building, context checks, running a
request on the engine, and rendering its outputs as OpenAI responses or stream chunks.

The HTTP handlers (openai_api.py) and the offline batch job both use this module, so a
batch result body is byte-for-byte what the server would have answered.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.server import protocol as P
from radixserve.server.auth import cache_namespace
from radixserve.server.errors import ApiError, api_error_from, bad_request


@dataclass(frozen=True)
class ModelInfo:
    """What the protocol layer needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))


def model_info(engine, name: str | None = None) -> ModelInfo:
    """ModelInfo from an engine: its effective context length and vocabulary."""
    max_len = getattr(engine, "max_model_len", None) or engine.config.max_model_len
    if not max_len:
        raise RuntimeError("the engine reports no max_model_len")
    return ModelInfo(name=name or engine.config.model, max_model_len=int(max_len),
                     vocab_size=int(engine.tokenizer.vocab_size))


@dataclass
class Prepared:
    """A validated request, ready for engine.generate."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None
    echo_text: str = ""


# ---------------------------------------------------------------- preparing requests


def check_model(requested: str | None, info: ModelInfo) -> None:
    if requested and requested != info.name:
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves {info.name!r}",
                       type="not_found_error", param="model", code="model_not_found")


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_request(f"{param}[{i}]" if param else None,
                              f"'{param}[{i}]' = {t} is outside the vocabulary [0, {vocab_size})",
                              "invalid_token_id")


def fit_context(prompt_len: int, max_tokens: int | None, info: ModelInfo, prompt_param: str) -> int:
    """max_tokens to run with. Like vLLM: a prompt that leaves no room, or an explicit
    max_tokens that would run past the context, is refused (never truncated or clamped);
    an absent max_tokens means 'up to the end of the context'."""
    if prompt_len == 0:
        raise bad_request(prompt_param, f"'{prompt_param}' is empty")
    if prompt_len >= info.max_model_len:
        raise bad_request(prompt_param,
                          f"the prompt ('{prompt_param}') is {prompt_len} tokens but the context holds "
                          f"{info.max_model_len} tokens, including at least one generated token",
                          "context_length_exceeded")
    room = info.max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request("max_tokens",
                          f"'max_tokens' = {max_tokens} plus the prompt's {prompt_len} tokens "
                          f"exceeds the context of {info.max_model_len} tokens "
                          f"(at most {room} allowed for this prompt)",
                          "context_length_exceeded")
    return max_tokens


def validated_params(params: SamplingParams, info: ModelInfo) -> SamplingParams:
    try:
        params.validate(info.vocab_size)
    except Exception as exc:        # InvalidRequest -> 400 naming the field
        raise api_error_from(exc) from None
    return params


def prepare_chat(req: P.ChatCompletionRequest, tokenizer, info: ModelInfo,
                 key_namespace: str | None = None, *, strict_model: bool = True) -> Prepared:
    req.check()
    if strict_model:
        check_model(req.model, info)
    messages = req.message_dicts()
    try:
        prompt_ids = list(tokenizer.apply_chat_template(messages))
    except Exception as exc:        # a template's own raise_exception(...): bad message order
        raise bad_request("messages", f"the chat template refused the messages: {exc}") from None
    max_tokens = fit_context(len(prompt_ids), req.requested_max_tokens(), info, "messages")
    params = validated_params(req.sampling_params(max_tokens, req.requested_logprobs()), info)
    return Prepared(prompt_ids, params, cache_namespace(key_namespace, req.cache_salt))


def prepare_completion(req: P.CompletionRequest, tokenizer, info: ModelInfo,
                       key_namespace: str | None = None, *, strict_model: bool = True) -> Prepared:
    req.check()
    if strict_model:
        check_model(req.model, info)
    prompt = req.prompt_value()
    if isinstance(prompt, str):
        prompt_ids = list(tokenizer.encode(prompt))
        echo_text = prompt
    else:
        check_token_ids(prompt, info.vocab_size, "prompt")
        prompt_ids = prompt
        echo_text = tokenizer.decode(prompt) if req.echo else ""
    max_tokens = fit_context(len(prompt_ids), req.max_tokens, info, "prompt")
    params = validated_params(req.sampling_params(max_tokens, req.logprobs), info)
    return Prepared(prompt_ids, params, cache_namespace(key_namespace, req.cache_salt),
                    echo_text if req.echo else "")


# ---------------------------------------------------------------- running on the engine


class Observer(Protocol):
    def on_output(self, out: RequestOutput) -> None: ...


async def engine_outputs(engine, prepared: Prepared, observer: Observer | None = None,
                         request_id: str | None = None) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request. Leaving early (client gone, cancellation, an
    error while writing) aborts the request so its pages are released: use it inside
    `contextlib.aclosing` so that happens at once, not when the garbage collector runs."""
    request_id = request_id or uuid.uuid4().hex
    unfinished = prepared.params.n
    stream = engine.generate(prepared.prompt_ids, prepared.params,
                             namespace=prepared.namespace, request_id=request_id)
    try:
        async for out in stream:
            if out.finished:
                unfinished -= 1
            if observer is not None:
                observer.on_output(out)
            yield out
    finally:
        if unfinished > 0:
            engine.abort(request_id)
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


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


class Renderer:
    """Accumulates a request's outputs and renders OpenAI bodies (chat or completions)."""

    def __init__(self, kind: str, model: str, prepared: Prepared, tokenizer):
        if kind not in ("chat", "completion"):
            raise ValueError(kind)
        self.kind = kind
        self.model = model
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(prepared.params.n)]
        self.prompt_tokens = len(prepared.prompt_ids)
        self.cached_tokens = 0
        self.wants_logprobs = prepared.params.logprobs is not None

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
        return c

    def usage(self) -> P.UsageInfo:
        completion = sum(c.completion_tokens if c.completion_tokens is not None else c.num_tokens
                         for c in self.choices)
        return P.usage_info(self.prompt_tokens, completion, self.cached_tokens)

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

    # -- whole responses

    def response(self) -> P.ChatCompletionResponse | P.CompletionResponse:
        if self.kind == "chat":
            return P.ChatCompletionResponse(
                id=self.id, object="chat.completion", created=self.created, model=self.model,
                choices=[P.ChatChoice(i, P.AssistantMessage("assistant", "".join(c.text)),
                                      self._chat_logprobs(c.logprobs), c.finish_reason,
                                      c.stop_reason)
                         for i, c in enumerate(self.choices)],
                usage=self.usage())
        choices = []
        for i, c in enumerate(self.choices):
            c.text_offset = len(self.prepared.echo_text)
            choices.append(P.CompletionChoice(
                i, self.prepared.echo_text + "".join(c.text),
                self._completion_logprobs(c, c.logprobs), c.finish_reason, c.stop_reason))
        return P.CompletionResponse(id=self.id, object="text_completion", created=self.created,
                                    model=self.model, choices=choices, usage=self.usage())

    # -- stream chunks

    def chunk(self, out: RequestOutput):
        """The stream chunk for one output (call after `add`), or None if it says nothing."""
        c = self.choices[out.index]
        first = not c.started
        c.started = True
        finish = out.finish_reason if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        if self.kind == "chat":
            if not (first or out.text or finish or out.logprobs):
                return None
            delta = P.DeltaMessage(role="assistant" if first else None,
                                   content=out.text if (out.text or first) else None)
            choice = P.ChatChunkChoice(out.index, delta, self._chat_logprobs(out.logprobs),
                                       finish, stop_reason)
            return P.ChatCompletionChunk(id=self.id, object="chat.completion.chunk",
                                         created=self.created, model=self.model, choices=[choice])
        text = (self.prepared.echo_text if first else "") + out.text
        if first:
            c.text_offset = len(self.prepared.echo_text)
        if not (text or finish or out.logprobs):
            return None
        choice = P.CompletionChoice(out.index, text, self._completion_logprobs(c, out.logprobs),
                                    finish, stop_reason)
        return P.CompletionChunk(id=self.id, object="text_completion", created=self.created,
                                 model=self.model, choices=[choice])

    def usage_chunk(self):
        cls = P.ChatCompletionChunk if self.kind == "chat" else P.CompletionChunk
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return cls(id=self.id, object=obj, created=self.created, model=self.model, choices=[],
                   usage=self.usage())

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


async def run_to_response(engine, renderer: Renderer, observer: Observer | None = None,
                          request_id: str | None = None):
    """Run a prepared request to completion and return its full response body."""
    async with aclosing(engine_outputs(engine, renderer.prepared, observer, request_id)) as outputs:
        async for out in outputs:
            renderer.add(out)
            if out.finished and (err := Renderer.failure(out)) is not None:
                raise err
    return renderer.response()
