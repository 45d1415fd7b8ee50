"""Anthropic `cache_control` breakpoints: where each one falls in the prompt's token ids, the
TTL pin that keeps that prefix cached (refreshed by every request that marks it again), and
the usage split into `cache_read_input_tokens`, `cache_creation_input_tokens` and
`input_tokens`, from the engine's exact count of the tokens it did not compute.

A breakpoint's position is the longest common prefix of the whole prompt's ids and the ids
of the conversation cut right after the marked block (rendered by the same template): what
a later request with the same blocks up to there shares, whatever follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.miss_reasons import common_prefix
from radixserve.server.anthropic_protocol import Breakpoint, MessagesRequest
from radixserve.server.errors import ApiError
from radixserve.server.prompts import PromptBuilder
from radixserve.server.timed_pins import TimedPins


@dataclass(frozen=True)
class PlacedBreakpoint:
    mark: Breakpoint
    tokens: int                 # the prompt's first `tokens` ids are what it caches


@dataclass(frozen=True)
class CacheUsage:
    input_tokens: int                   # computed, after the last breakpoint
    cache_creation_input_tokens: int    # computed and kept up to the last breakpoint
    cache_read_input_tokens: int        # not computed: served from the cache


async def place(req: MessagesRequest, marks: list[Breakpoint], prompts: PromptBuilder,
                prompt_ids: list[int]) -> list[PlacedBreakpoint]:
    placed = []
    for mark in marks:
        ids = await prompts.chat(req.chat_messages(upto=mark), False)
        placed.append(PlacedBreakpoint(mark, common_prefix(ids, prompt_ids)))
    return placed


async def check_budget(pins: TimedPins, placed: list[PlacedBreakpoint], prompt_ids: list[int],
                 namespace: str | None) -> None:
    """400 naming the breakpoint whose prefix the pin budget cannot take (live pins of
    other prefixes are never released for it); a prefix pinned already costs nothing."""
    room = await pins.room()
    for p in placed:
        prefix = prompt_ids[:p.tokens]
        if pins.holds(prefix, namespace):
            continue
        room -= p.tokens
        if room < 0:
            raise ApiError(400, f"the cache breakpoint at {p.mark.path} covers {p.tokens} "
                                f"tokens, more than the {room + p.tokens} tokens left of the "
                                f"cache pin budget ({pins.budget_tokens}, "
                                f"--cache-control-pin-tokens)",
                           param=p.mark.path, code="pin_budget_exceeded")


async def keep(pins: TimedPins, placed: list[PlacedBreakpoint], prompt_ids: list[int],
               namespace: str | None) -> None:
    """Pin (or refresh) every breakpoint's prefix for its TTL, once the request computed it."""
    for p in placed:
        if p.tokens:
            await pins.take(prompt_ids[:p.tokens], namespace, p.mark.ttl_s, make_room=False)


def split_usage(prompt_tokens: int, cached_tokens: int,
                placed: list[PlacedBreakpoint]) -> CacheUsage:
    """Read = what the engine did not compute; creation = the rest up to the last
    breakpoint; input = the rest. The three add up to the prompt."""
    last = max((p.tokens for p in placed), default=0)
    creation = max(0, last - cached_tokens)
    return CacheUsage(prompt_tokens - cached_tokens - creation, creation, cached_tokens)
