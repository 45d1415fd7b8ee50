"""OpenAI and native request/response schemas (msgspec), and their mapping to SamplingParams.

Decoding validates types and ranges in one pass; fields a client sends that are not declared
here are ignored, as OpenAI's server ignores them. Fields OpenAI defines but this server
does not implement are declared so that a non-default value is refused (400) instead of
silently changing the meaning of a request. Transport-free: the batch job reuses it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct, field

from radixserve.engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from radixserve.server.errors import bad_request, from_decode_error, unsupported

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Meta(ge=0)]

T = TypeVar("T")


def decode(body: bytes, type: type[T]) -> T:
    """JSON body -> validated request struct, or ApiError(400) naming the field. Nesting
    deeper than the interpreter's recursion limit (hostile `[[[[...`) is a 400 as well."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise bad_request(None, "request body is nested too deeply", "invalid_json") from None


# ---------------------------------------------------------------- shared request parts


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    """response_format's `json_schema` (OpenAI): the schema the output must validate against."""

    name: str = "response"
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None     # type "json_schema"

    def check(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise unsupported("response_format.type",
                              f"response_format {self.type!r} is not supported "
                              f"(text, json_object, json_schema)")
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema is None):
            raise bad_request("response_format.json_schema.schema",
                              "response_format 'json_schema' needs 'json_schema.schema'")


class _SamplingFields(Struct, kw_only=True):
    """Fields chat and completions share (OpenAI names, plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None                 # vLLM / SGLang extension
    min_p: MinP | None = None                 # vLLM / SGLang extension
    n: NumChoices = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None   # vLLM extension
    ignore_eos: bool = False                      # vLLM extension
    include_stop_str_in_output: bool = False      # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None             # vLLM's name: the prefix-cache namespace
    prompt_cache_key: str | None = None       # OpenAI: a routing / grouping hint, not a namespace

    def check_common(self) -> None:
        """Refuse what validates as JSON but cannot be honoured."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "'stream_options' is only allowed when 'stream' is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, f"'{name}' is not supported (only 0)")
        if self.logit_bias:
            raise unsupported("logit_bias", "'logit_bias' is not supported")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt", "'cache_salt' must be a non-empty string")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else float(self.min_p),
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_key=self.prompt_cache_key,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---------------------------------------------------------------- chat requests


class ContentPart(Struct, kw_only=True, gc=False):
    type: str
    text: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(Struct, kw_only=True):
    """A call an assistant message of the history made (OpenAI's shape)."""

    id: str
    type: str = "function"
    function: FunctionCall


# gc=False (and on ContentPart): decoded JSON cannot form cycles, and 200,000 tracked
# messages in one body meant ~270 collections holding the GIL while streams waited (issue 39)
class ChatMessage(Struct, kw_only=True, gc=False):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None      # assistant: the calls it made
    tool_call_id: str | None = None                 # tool: the call this answers

    def text(self, where: str) -> str:
        """The message's text; image/audio parts are refused (400)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.type != "text":
                raise unsupported(f"{where}.content[{i}].type",
                                  f"content part type {part.type!r} is not supported (text only)")
            if part.text is None:
                raise bad_request(f"{where}.content[{i}].text", "a text content part needs 'text'")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages", "'messages' must contain at least one message")
        if self.response_format is not None:
            self.response_format.check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs", "'top_logprobs' requires 'logprobs': true")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, str]]:
        return message_dicts(self.messages)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them ('developer' is the new 'system')."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": m.text(f"messages[{i}]")})
    return out


# ---------------------------------------------------------------- completions requests


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[int | str | list[int]]
    max_tokens: PositiveInt | None = 16            # OpenAI's default for completions
    logprobs: NumLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        self.check_common()
        if self.response_format is not None:
            self.response_format.check()
        if self.suffix:
            raise unsupported("suffix", "'suffix' (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "'best_of' other than 'n' is not supported")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "'echo' with 'logprobs' (prompt logprobs) is not supported")

    def prompt_value(self) -> str | list[int]:
        """One text prompt or one list of token ids; batched prompts are refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("prompt", "'prompt' must not be empty")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) == 1 and isinstance(p[0], str):
            return p[0]
        if len(p) == 1 and isinstance(p[0], list):
            return list(p[0])
        raise unsupported("prompt", "'prompt' must be one string or one list of token ids; "
                                    "send one request per prompt")


# ---------------------------------------------------------------- native /generate


class NativeSampling(Struct, kw_only=True):
    max_new_tokens: PositiveInt | None = None       # SGLang's name
    max_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    logprobs: NumLogprobs | None = None
    include_stop_str_in_output: bool = False
    json_schema: str | dict[str, Any] | None = None   # constrained output (SGLang's names):
    regex: str | None = None                          #   at most one of these four
    ebnf: str | None = None                           #   (GBNF, as llama.cpp writes it)
    lark: str | None = None

    def to_params(self, max_tokens: int) -> SamplingParams:
        stop = [] if self.stop is None else ([self.stop] if isinstance(self.stop, str) else self.stop)
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=list(stop),
                              stop_token_ids=list(self.stop_token_ids or []),
                              ignore_eos=self.ignore_eos, n=1, logprobs=self.logprobs,
                              include_stop_str_in_output=self.include_stop_str_in_output)


class GenerateRequest(Struct, kw_only=True):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = field(default_factory=NativeSampling)
    stream: bool = False
    cache_salt: str | None = None

    def check(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("text", "give exactly one of 'text' and 'input_ids'")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt", "'cache_salt' must be a non-empty string")

    def requested_max_tokens(self) -> int | None:
        s = self.sampling_params
        return s.max_new_tokens if s.max_new_tokens is not None else s.max_tokens


# ---------------------------------------------------------------- POST /cache/pin


class PinRequest(Struct, kw_only=True):
    """A prefix to keep in the KV pool: exactly one of `prompt` (text), `messages` (chat,
    rendered by the chat template; without the generation prompt unless asked, since a
    pinned prefix is the start of later conversations) and `token_ids`."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    add_generation_prompt: bool = False
    cache_salt: str | None = None
    namespace: str | None = None        # admin only: a namespace id as /cache/tree names it

    def check(self) -> None:
        given = [name for name in ("prompt", "messages", "token_ids")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise bad_request(given[1] if len(given) > 1 else "prompt",
                              "give exactly one of 'prompt', 'messages' and 'token_ids'")
        if self.messages is not None and not self.messages:
            raise bad_request("messages", "'messages' must contain at least one message")
        if self.token_ids is not None and not self.token_ids:
            raise bad_request("token_ids", "'token_ids' must not be empty")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt", "'cache_salt' must be a non-empty string")
        if self.namespace is not None and not self.namespace:
            raise bad_request("namespace", "'namespace' must be a non-empty string")


class PinResponse(Struct):
    id: str
    object: str                 # "cache.pin"
    pinned_tokens: int          # the prompt's whole KV pages
    cached_tokens: int          # of those, already cached before this call
    prompt_tokens: int
    namespace: str              # as /cache/tree names it ("default" for no namespace)
    created: bool               # False: this prefix was pinned already (same id)


class PinEntry(Struct):
    id: str
    pinned_tokens: int
    namespace: str


class UnpinResponse(Struct):
    id: str
    object: str                 # "cache.pin"
    deleted: bool
    pinned_tokens: int
    namespace: str


# ---------------------------------------------------------------- responses


class PromptTokensDetails(Struct):
    cached_tokens: int


class UsageInfo(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    radixserve: dict[str, Any] | None = None    # extension: how the prompt met the cache


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class ToolCallFunction(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    type: str
    function: ToolCallFunction


class AssistantMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed call (OpenAI's shape): the first delta of a call has id, type and name
    (arguments ""), the later ones argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Struct):
    object: str
    data: list[ModelCard]


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               extension: dict[str, Any] | None = None) -> UsageInfo:
    return UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                     PromptTokensDetails(cached_tokens), extension)

