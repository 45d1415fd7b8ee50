"""Turning a decoded request into a `Prepared` one: token ids, checked sampling params and
cache namespace, with tokenizing and chat-template rendering on a worker thread.

Tokenizing a 5 MB prompt takes seconds; on the event loop it would stall every other
stream and `/health`. So prompts are (1) refused at once when their length in characters
already proves they cannot fit (`PromptBuilder.check_chars`), and (2) tokenized on a small
thread pool. Transport-free: the batch job uses it too.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from radixserve.engine.errors import InvalidRequest
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.validation import check_token_ids, fit_max_tokens
from radixserve.server import protocol as P
from radixserve.server.auth import cache_namespace
from radixserve.server.engine_client import EngineClient, TokenizerClient
from radixserve.server.errors import ApiError, api_error_from, bad_request
from radixserve.server.structured import (ToolOutput, auto_call_grammar, compile_for,
                                          native_spec, response_format_spec)
from radixserve.server.tools import (call_format, call_grammar, check_history,
                                     parse_tool_choice, parse_tools, render_messages)

if TYPE_CHECKING:
    from radixserve.engine.grammar_cache import GrammarCompiler

T = TypeVar("T")
TOKENIZER_THREADS = 2               # at most this many prompts tokenized at once
DEFAULT_MAX_NEW_TOKENS = 128        # /generate: SGLang's default when the request names none


@dataclass(frozen=True)
class ModelInfo:
    """What the protocol layer needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    max_token_chars: int = 1        # the longest vocabulary entry, in characters
    created: int = field(default_factory=lambda: int(time.time()))


def model_info(engine: EngineClient, name: str | None = None) -> ModelInfo:
    """ModelInfo from an engine: its effective context length and vocabulary."""
    if not engine.max_model_len:
        raise RuntimeError("the engine reports no max_model_len")
    tok = engine.tokenizer
    return ModelInfo(name=name or engine.config.model, max_model_len=int(engine.max_model_len),
                     vocab_size=int(tok.vocab_size),
                     max_token_chars=max(1, int(tok.max_token_chars)))


@dataclass
class Prepared:
    """A validated request, ready for engine.generate."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None
    echo_text: str = ""
    tools: ToolOutput | None = None     # chat with tools: the output may hold calls


def checked(fn: Callable[..., T], *args: Any) -> T:
    """Run a shared engine check, turning its InvalidRequest into the 400 it stands for."""
    try:
        return fn(*args)
    except InvalidRequest as exc:
        raise api_error_from(exc) from None


class PromptBuilder:
    """Token ids for text and chat prompts, computed off the event loop, after a cheap
    length check. A text of C characters encodes to at least C / `max_token_chars` tokens
    (every vocabulary entry covers at most that many characters; true of byte-level BPE and
    SentencePiece tokenizers without a normalizer that drops characters), so a prompt
    whose bound alone reaches the context is refused without tokenizing it."""

    def __init__(self, tokenizer: TokenizerClient, info: ModelInfo,
                 threads: int = TOKENIZER_THREADS, grammars: GrammarCompiler | None = None):
        self.tokenizer = tokenizer
        self.info = info
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="radixserve-tokenize")
        self._grammars = grammars

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles response_format / tool / native grammars (memory-only unless given)."""
        if self._grammars is None:
            from radixserve.engine.grammar_cache import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._grammars is not None:
            self._grammars.close()

    def check_chars(self, chars: int, parts: int, param: str) -> None:
        """Refuse a prompt whose size alone proves it cannot fit: C characters make at
        least C / max_token_chars tokens, and every chat message at least one."""
        at_least = max(-(-chars // self.info.max_token_chars), parts)
        if at_least >= self.info.max_model_len:
            raise bad_request(param, f"the prompt ('{param}') has {chars} characters in {parts} "
                                     f"part(s), at least {at_least} tokens, but the context holds "
                                     f"{self.info.max_model_len} tokens",
                              "context_length_exceeded")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, param: str) -> list[int]:
        self.check_chars(len(text), 1, param)
        return await self._off_loop(self.tokenizer.encode, text)

    async def chat(self, messages: list[dict[str, str]],
                   add_generation_prompt: bool = True,
                   tools: list[dict] | None = None) -> list[int]:
        self.check_chars(sum(len(m["content"]) for m in messages), len(messages), "messages")
        extra = (tools,) if tools else ()
        try:
            return await self._off_loop(self.tokenizer.apply_chat_template, messages,
                                        add_generation_prompt, *extra)
        except Exception as exc:    # a template's own raise_exception(...): bad message order
            raise bad_request("messages", f"the chat template refused the messages: "
                                          f"{str(exc)[:200]}") from None

    async def decode(self, ids: list[int]) -> str:
        return await self._off_loop(self.tokenizer.decode, ids)


# ---------------------------------------------------------------- preparing requests


def check_model(requested: str | None, info: ModelInfo) -> None:
    if requested and requested != info.name:
        raise ApiError(404, f"the model {requested[:200]!r} does not exist; this server serves "
                            f"{info.name!r}",
                       type="not_found_error", param="model", code="model_not_found")


def fit_context(prompt_len: int, max_tokens: int | None, info: ModelInfo, prompt_param: str) -> int:
    """max_tokens to run with (see engine/validation.py: fit_max_tokens), or a 400."""
    return checked(fit_max_tokens, prompt_len, max_tokens, info.max_model_len, prompt_param)


def validated_params(params: SamplingParams, info: ModelInfo) -> SamplingParams:
    checked(params.validate, info.vocab_size)
    return params


def token_ids(ids: list[int], info: ModelInfo, param: str) -> list[int]:
    checked(check_token_ids, ids, info.vocab_size, param)
    return ids


async def prepare_chat(req: P.ChatCompletionRequest, prompts: PromptBuilder,
                       key_namespace: str | None = None, *, strict_model: bool = True) -> Prepared:
    info = prompts.info
    req.check()
    if strict_model:
        check_model(req.model, info)
    params = req.sampling_params(1, req.requested_logprobs())
    validated_params(params, info)               # before the costly part: the template
    prompts.check_chars(0, len(req.messages), "messages")
    toolset = parse_tools(req.tools) if req.tools else None
    choice = parse_tool_choice(req.tool_choice, toolset)
    check_history(req.messages)
    spec, field = response_format_spec(req.response_format), "response_format"
    fmt = call_format(prompts.tokenizer)
    if choice.forces_call:
        spec, field = call_grammar(toolset, choice, req.parallel_tool_calls, fmt), "tools"
    elif choice.mode == "auto" and spec is None:
        params.grammar = await auto_call_grammar(prompts.grammars, toolset, choice,
                                                 req.parallel_tool_calls, fmt)
    if spec is not None:
        params.grammar = await compile_for(prompts.grammars, spec, field)
    if params.grammar is not None:
        validated_params(params, info)
    if toolset is None and not any(m.tool_calls for m in req.messages):
        prompt_ids = await prompts.chat(req.message_dicts())
    else:
        native = bool(getattr(prompts.tokenizer, "template_renders_tools", False))
        texts = [m.text(f"messages[{i}]") for i, m in enumerate(req.messages)]
        messages, tools = render_messages(req.messages, texts, toolset, native)
        prompt_ids = await prompts.chat(messages, tools=tools)
    params.max_tokens = fit_context(len(prompt_ids), req.requested_max_tokens(), info, "messages")
    tools_out = ToolOutput(toolset, choice) if toolset and choice.mode != "none" else None
    return Prepared(prompt_ids, params, cache_namespace(key_namespace, req.cache_salt),
                    tools=tools_out)


async def prepare_completion(req: P.CompletionRequest, prompts: PromptBuilder,
                             key_namespace: str | None = None, *,
                             strict_model: bool = True) -> Prepared:
    info = prompts.info
    req.check()
    if strict_model:
        check_model(req.model, info)
    params = validated_params(req.sampling_params(1, req.logprobs), info)
    spec = response_format_spec(req.response_format)
    if spec is not None:
        params.grammar = await compile_for(prompts.grammars, spec, "response_format")
        validated_params(params, info)
    prompt = req.prompt_value()
    echo_text = ""
    if isinstance(prompt, str):
        prompt_ids = await prompts.encode(prompt, "prompt")
        echo_text = prompt
    else:
        prompt_ids = token_ids(prompt, info, "prompt")
        if req.echo:
            echo_text = await prompts.decode(prompt)
    params.max_tokens = fit_context(len(prompt_ids), req.max_tokens, info, "prompt")
    return Prepared(prompt_ids, params, cache_namespace(key_namespace, req.cache_salt),
                    echo_text if req.echo else "")


async def prepare_generate(req: P.GenerateRequest, prompts: PromptBuilder,
                           key_namespace: str | None) -> Prepared:
    info = prompts.info
    req.check()
    params = validated_params(req.sampling_params.to_params(1), info)
    spec, field = native_spec(req.sampling_params)
    if spec is not None:
        params.grammar = await compile_for(prompts.grammars, spec, field)
        validated_params(params, info)
    if req.input_ids is not None:
        prompt_ids, param = token_ids(list(req.input_ids), info, "input_ids"), "input_ids"
    else:
        prompt_ids, param = await prompts.encode(req.text, "text"), "text"
    requested = req.requested_max_tokens()
    if requested is None:
        room = fit_context(len(prompt_ids), None, info, param)
        params.max_tokens = min(DEFAULT_MAX_NEW_TOKENS, room)
    else:
        params.max_tokens = fit_context(len(prompt_ids), requested, info, param)
    return Prepared(prompt_ids, params, cache_namespace(key_namespace, req.cache_salt))


async def prepare_pin(req: P.PinRequest, prompts: PromptBuilder,
                      base_namespace: str | None) -> tuple[list[int], str | None]:
    """A pin's token ids (checked as a request's prompt would be: vocabulary, and room in
    the context for the one token its computing request samples) and its namespace:
    `base_namespace` refined by the body's `cache_salt`, as for requests."""
    info = prompts.info
    req.check()
    if req.token_ids is not None:
        ids, param = token_ids(list(req.token_ids), info, "token_ids"), "token_ids"
    elif req.messages is not None:
        prompts.check_chars(0, len(req.messages), "messages")
        ids = await prompts.chat(P.message_dicts(req.messages), req.add_generation_prompt)
        param = "messages"
    else:
        ids, param = await prompts.encode(req.prompt, "prompt"), "prompt"
    fit_context(len(ids), 1, info, param)
    return ids, cache_namespace(base_namespace, req.cache_salt)
