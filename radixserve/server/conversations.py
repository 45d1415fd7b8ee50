"""Conversations the server keeps: stored responses, the pins that keep their tokens in the
KV pool, and the prompt of a follow-up turn built from the previous turn's exact ids.

A stored response holds its prompt + reply ids and a TimedPins pin on them (all but the last
reply token, whose KV is never computed). A follow-up with `previous_response_id` extends
those ids (conversation_ids.py), so its prompt's whole history is in the tree by
construction; its own pin then replaces the previous turn's (it covers it). A pin that
lapsed or was released for room only means the history is recomputed from the stored ids
(or loaded from host/disk), never that the follow-up is refused.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from radixserve.server.conversation_ids import next_turn_ids
from radixserve.server.engine_client import EngineClient
from radixserve.server.prompts import Prepared, PromptBuilder, fit_context, prepare_chat
from radixserve.server.response_store import STORE_SUBDIR, ResponseStore, StoredResponse
from radixserve.server.responses_protocol import ResponsesRequest
from radixserve.server.responses_tools import stored_turn
from radixserve.server.timed_pins import TimedPins


@dataclass(frozen=True)
class ConversationConfig:
    """Bounds on what stored responses may hold (`serve` flags `--response-*`)."""

    max_responses: int = 10_000         # stored responses, least recently used dropped first
    max_tokens: int = 16_000_000        # their token ids, summed (~8 bytes each in memory)
    ttl_s: float = 24 * 3600.0          # a response unused this long is dropped (404)
    pin_ttl_s: float = 300.0            # its KV stays pinned this long after its last use
    pin_tokens: int | None = None       # the pins' budget; None: the engine's pin budget
    cache_control_pin_tokens: int | None = None     # /v1/messages breakpoints' pin budget


@dataclass
class TurnPrompt:
    """A response's prompt, ready to run, and how it was built."""

    prepared: Prepared
    messages: list[dict]                # the conversation as the template sees it
    previous: StoredResponse | None
    source: str                         # "new" | "extended" | "rendered"
    history_pinned: bool                # the previous turn's pin was still held


class Conversations:
    def __init__(self, engine: EngineClient, config: ConversationConfig,
                 directory: Path | None = None, clock: Callable[[], float] = time.time,
                 model_id: str = ""):
        self.config = config
        self.model_id = model_id        # a stored response of another model is re-rendered
        pin_budget = config.pin_tokens
        if pin_budget is None:
            pin_budget = engine.stats().pinned_tokens_limit
        self.store = ResponseStore(config.max_responses, config.max_tokens, config.ttl_s,
                                   directory, clock)
        self.pins = TimedPins(engine, config.pin_ttl_s, pin_budget, clock)
        breakpoint_budget = config.cache_control_pin_tokens
        if breakpoint_budget is None:
            breakpoint_budget = engine.stats().pinned_tokens_limit
        # Anthropic cache_control: each pin has its own TTL (5m / 1h); cache_breakpoints.py
        self.breakpoints = TimedPins(engine, 3600.0, breakpoint_budget, clock)

    @classmethod
    def for_engine(cls, engine: EngineClient, config: ConversationConfig) -> "Conversations":
        """Stored responses on disk beside the KV when the engine has --kv-disk-dir."""
        disk = getattr(engine.config, "kv_disk_dir", None)
        if not disk:
            return cls(engine, config)
        return cls(engine, config, Path(disk) / STORE_SUBDIR, model_id=model_identity(engine))

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Tests move time instead of sleeping."""
        self.store.clock = clock
        self.pins.clock = clock
        self.breakpoints.clock = clock

    async def prompt(self, req: ResponsesRequest, prompts: PromptBuilder, owner: str | None,
                     key_namespace: str | None) -> TurnPrompt:
        """The turn's prompt: the previous turn's ids extended when there is one (404 for an
        unknown, lapsed or other-tenant id), else the rendered input."""
        req.check()
        new = req.new_messages()
        previous = None
        if req.previous_response_id is None:
            head = [] if req.instructions is None else [
                {"role": "system", "content": req.instructions}]
            history: list[dict] = head
        else:
            previous = self.store.get(req.previous_response_id, owner, "previous_response_id")
            history = previous.messages + [stored_turn(previous.body, previous.reply)]
            if req.instructions is not None:
                history = _with_instructions(history, req.instructions)
        messages = history + new
        prepared = await prepare_chat(req.chat_request(messages), prompts, key_namespace)
        if previous is None:
            return TurnPrompt(prepared, messages, None, "new", False)
        pinned = await self.pins.refresh(previous.pin_id)
        ids = None
        # Tool turns render through tools.render_messages (the tools block, calls, results),
        # which next_turn_ids' plain template diff does not: they are re-rendered.
        # Ids stored by another model (a restart on other weights) are never extended.
        if previous.namespace == prepared.namespace and history[:-1] == previous.messages \
                and not req.uses_tools(messages) and previous.model == self.model_id:
            ids = await next_turn_ids(prompts.chat, history[:-1], previous.token_ids, new)
        if ids is None:
            return TurnPrompt(prepared, messages, previous, "rendered", pinned)
        prepared.prompt_ids = ids
        prepared.params.max_tokens = fit_context(len(ids), req.max_output_tokens, prompts.info,
                                                 "input")
        return TurnPrompt(prepared, messages, previous, "extended", pinned)

    async def remember(self, turn: TurnPrompt, owner: str | None, response_id: str,
                       reply: str, reply_ids: list[int], body: dict, created_at: int) -> None:
        """Store a finished response and pin its ids; the previous turn's pin is released
        (the new one covers it), and so are the pins of responses dropped for room."""
        ids = list(turn.prepared.prompt_ids) + list(reply_ids)
        item = StoredResponse(id=response_id, owner=owner, namespace=turn.prepared.namespace,
                              created_at=created_at, last_used=0.0, messages=turn.messages,
                              reply=reply, token_ids=ids, body=body, model=self.model_id)
        for dropped in self.store.put(item):
            await self.pins.release(dropped.pin_id)
        item.pin_id = await self.pins.take(ids[:-1], item.namespace)
        if turn.previous is not None and turn.previous.pin_id != item.pin_id:
            await self.pins.release(turn.previous.pin_id)
            turn.previous.pin_id = None

    async def delete(self, response_id: str, owner: str | None) -> StoredResponse:
        item = self.store.delete(response_id, owner)
        await self.pins.release(item.pin_id)
        return item

    async def close(self) -> None:
        await self.pins.release_all()
        await self.breakpoints.release_all()


def model_identity(engine: EngineClient) -> str:
    """What stored token ids are valid for across restarts: the KV disk store's model
    fingerprint (weights, dtype, KV layout, K/V code), or, for an engine without a local
    model runner (replicas, tests), the configured model."""
    runner = getattr(engine, "runner", None)
    if runner is None:
        return f"model={engine.config.model}"
    from radixserve.engine.kv_persistence import engine_fingerprint
    fingerprint = engine_fingerprint(engine.config, runner)
    return hashlib.sha256(msgspec.json.encode(fingerprint)).hexdigest()


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


def _with_instructions(history: list[dict], instructions: str) -> list[dict]:
    """`instructions` replace the conversation's leading system message (or lead it)."""
    rest = history[1:] if history and history[0]["role"] == "system" else history
    return [{"role": "system", "content": instructions}] + rest
