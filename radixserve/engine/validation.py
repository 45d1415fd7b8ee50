"""Request checks shared by the engine and the HTTP server, in one place.

The server runs them before a request reaches the engine (to name the client's own field in
an OpenAI-style 400); the engine runs them again for callers that skip the server (chat CLI,
batch job, tests). Messages quote field names as OpenAI's do; echoed values are cut short
(`shorten`) so a hostile value never makes a huge error body.
"""

from __future__ import annotations

from typing import Sequence

from radixserve.engine.errors import InvalidRequest
from radixserve.engine.sampling_params import SamplingParams, shorten


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id in [0, vocab_size); the first bad one is named as `param[i]`."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"{param}[{i}]",
                                 f"'{param}[{i}]' = {shorten(t)} is outside the vocabulary "
                                 f"[0, {vocab_size})", code="invalid_token_id")


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int,
                   prompt_param: str) -> int:
    """max_tokens to run with. Like vLLM: a prompt that leaves no room, or an explicit
    max_tokens that would run past the context, is refused (never truncated or clamped);
    an absent max_tokens means 'up to the end of the context'."""
    if prompt_len == 0:
        raise InvalidRequest(prompt_param, f"'{prompt_param}' is empty")
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            prompt_param, f"the prompt ('{prompt_param}') is {prompt_len} tokens but the context "
                          f"holds {max_model_len} tokens, including at least one generated token",
            code="context_length_exceeded")
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequest(
            "max_tokens", f"'max_tokens' = {max_tokens} plus the prompt's {prompt_len} tokens "
                          f"exceeds the context of {max_model_len} tokens "
                          f"(at most {room} allowed for this prompt)",
            code="context_length_exceeded")
    return max_tokens


def check_request(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int, prompt_param: str = "prompt") -> None:
    """Everything a request must satisfy before it may be queued: InvalidRequest otherwise."""
    params.validate(vocab_size)
    check_token_ids(prompt_ids, vocab_size, prompt_param)
    fit_max_tokens(len(prompt_ids), params.max_tokens, max_model_len, prompt_param)
