"""A small engine that follows the Engine contract (docs/contracts.md) without a model.

Used for protocol-shape and routing tests that need exact control (token timing, queue
capacity, logprobs). The Show tests run against the real engine instead. It satisfies
`radixserve.server.engine_client.EngineClient` (checked at the bottom of this module).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from radixserve.engine.config import EngineConfig
from radixserve.engine.errors import (CacheBusy, EngineStopped, NoDiskStore, PinLimitExceeded,
                                      QueueFull, UnknownPin, Unsupported)
from radixserve.engine.outputs import (EngineStats, OneProcessStats, RequestOutput,
                                      TokenLogprob, Usage)
from radixserve.engine.pins import PinInfo
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.validation import check_request
from radixserve.server.engine_client import EngineClient

EOS = 256


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS."""

    vocab_size = 260
    max_token_chars = 1             # one token per byte: at least one per character
    eos_token_ids = frozenset({EOS})
    bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt=True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


@dataclass
class _Live:
    aborted: bool = False


class FakeEngine(OneProcessStats):
    """Sample i of a request answers `reply(i)` one byte per event, `delay_s` apart."""

    def __init__(self, max_model_len: int = 512, delay_s: float = 0.0, max_live: int = 1000,
                 reply: str = "Hello from the fake engine. " * 20):
        self.config = EngineConfig(model="fake-model", max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.tokenizer = ByteTokenizer()
        self.delay_s = delay_s
        self.max_live = max_live
        self.reply = reply
        self.live: dict[str, _Live] = {}
        self.seen: dict[str | None, list[list[int]]] = {}
        self.calls: list[tuple[list[int], SamplingParams, str | None]] = []
        self.aborted: list[str] = []
        self.stopped = False
        self.error: str | None = None           # set by a test: why it cannot serve
        self.gate: asyncio.Event | None = None  # set by a test: no output until it is set
        self._stats = EngineStats(pages_total=1024, page_size=1)
        self._stats.kv_pool_bytes = 1024 * 100
        self.pin_limit = 256
        self.pins: dict[str, tuple[PinInfo, tuple]] = {}   # id -> (info, (namespace, ids))

    @property
    def ready(self) -> bool:
        return not self.stopped

    async def start(self) -> None:
        self.stopped = False

    async def save_cache(self) -> dict:
        raise NoDiskStore("the fake engine has no disk store")

    async def shutdown(self, grace_s: float = 0, save_by: float | None = None) -> None:
        self.stopped = True
        for live in self.live.values():
            live.aborted = True

    def _cached(self, prompt: list[int], namespace: str | None) -> int:
        best = 0
        for old in self.seen.get(namespace, []):
            n = 0
            while n < min(len(old), len(prompt) - 1) and old[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    def generate(self, prompt_ids, params: SamplingParams, namespace=None, request_id=None):
        if self.stopped:
            raise EngineStopped("stopped")
        check_request(prompt_ids, params, self.tokenizer.vocab_size, self.max_model_len)
        if len(self.live) >= self.max_live:
            raise QueueFull(f"{len(self.live)} live")
        request_id = request_id or uuid.uuid4().hex
        self.calls.append((list(prompt_ids), params, namespace))
        self.live[request_id] = _Live()
        return self._stream(request_id, list(prompt_ids), params, namespace)

    async def _stream(self, rid, prompt, params, namespace):
        live = self.live[rid]
        arrival = time.monotonic()
        cached = self._cached(prompt, namespace)
        s = self._stats
        s.prefix_query_tokens += len(prompt)
        s.prefix_hit_tokens += cached
        s.prompt_tokens += len(prompt)
        texts = [""] * params.n
        counts = [0] * params.n
        done = [False] * params.n
        first = None
        try:
            if self.gate is not None:
                await self.gate.wait()
            while not all(done):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                for i in range(params.n):
                    if done[i]:
                        continue
                    now = time.monotonic()
                    if live.aborted:
                        done[i] = True
                        yield self._final(rid, i, "abort", None, prompt, counts[i], cached, arrival, first)
                        continue
                    reply = f"[{i}]" + self.reply
                    ch = reply[counts[i] % len(reply)]
                    tid = ord(ch)
                    counts[i] += 1
                    s.generation_tokens += 1
                    first = first or now
                    texts[i] += ch
                    lps = None
                    if params.logprobs is not None:
                        top = [(tid, -0.25)] + [(65 + k, -1.0 - k) for k in range(params.logprobs)][:max(0, params.logprobs - 1)]
                        lps = [TokenLogprob(tid, -0.25, top[:params.logprobs])]
                    stop_hit = next((st for st in params.stop if texts[i].endswith(st)), None)
                    if stop_hit is not None:
                        done[i] = True
                        yield RequestOutput(rid, i, [tid], "", True, "stop", None, lps,
                                            Usage(len(prompt), counts[i], cached), stop_hit,
                                            arrival, first, now)
                    elif counts[i] >= params.max_tokens:
                        done[i] = True
                        yield RequestOutput(rid, i, [tid], ch, True, "length", None, lps,
                                            Usage(len(prompt), counts[i], cached), None,
                                            arrival, first, now)
                    else:
                        yield RequestOutput(rid, i, [tid], ch, False, None, None, lps, None, None,
                                            arrival, first, now)
        finally:
            if not all(done):
                self.aborted.append(rid)
            for i, d in enumerate(done):
                reason = "abort" if not d or live.aborted else "ok"
                s.requests_finished[reason] = s.requests_finished.get(reason, 0) + 1
            self.seen.setdefault(namespace, []).append(prompt)
            del self.live[rid]

    def _final(self, rid, i, reason, err, prompt, count, cached, arrival, first):
        return RequestOutput(rid, i, [], "", True, reason, err, None,
                             Usage(len(prompt), count, cached), None, arrival, first, time.monotonic())

    def abort(self, request_id: str) -> None:
        if request_id in self.live:
            self.live[request_id].aborted = True

    def stats(self) -> EngineStats:
        """Pages as a page-size-1 engine would count them: one per remembered prompt token
        (the fake's cache, capped at the pool), the rest free; nothing private when idle."""
        s = self._stats
        s.running = len(self.live)
        s.pages_cached = min(s.pages_total, sum(len(p) for ps in self.seen.values() for p in ps))
        s.pages_private = 0
        s.pages_free = s.pages_total - s.pages_cached
        s.pinned_tokens = sum(info.tokens for info, _ in self.pins.values())
        s.pinned_prefixes = len(self.pins)
        s.pinned_tokens_limit = self.pin_limit
        return s

    def cache_tree(self, limit, namespace=None, *, label_key, reveal) -> dict:
        raise Unsupported("the fake engine has no tree")

    def describe_kv_cache(self) -> str:
        return "KV cache: the fake engine's prompts, no KV"

    def describe_weights(self) -> str:
        return "weights: the fake engine has none"

    async def flush_cache(self) -> None:
        if self.live:
            raise CacheBusy("busy")
        self.seen.clear()

    def _in_namespace(self, ns: str | None, namespace: str | None) -> bool:
        if namespace is None:
            return ns is None
        return ns is not None and (ns == namespace or ns.startswith(namespace + "/"))

    async def flush_namespace(self, namespace: str | None) -> int:
        """Pages freed: one per remembered prompt token (the fake's 'cache')."""
        gone = [ns for ns in self.seen if self._in_namespace(ns, namespace)]
        return sum(len(p) for ns in gone for p in self.seen.pop(ns))

    async def namespace_stats(self, namespace: str | None) -> dict[str, int]:
        prompts = [p for ns, ps in self.seen.items() if self._in_namespace(ns, namespace)
                   for p in ps]
        return {"cached_tokens": sum(map(len, prompts)), "locked_tokens": 0,
                "nodes": len(prompts)}

    async def pin(self, prompt_ids, namespace=None) -> PinInfo:
        """The engine's pin rules over the fake's 'cache': idempotent per (namespace, ids),
        bounded by `pin_limit`, cached tokens as a request would count them (+ the last)."""
        check_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0),
                      self.tokenizer.vocab_size, self.max_model_len)
        key = (namespace, tuple(prompt_ids))
        for info, k in self.pins.values():
            if k == key:
                return PinInfo(info.pin_id, info.tokens, namespace, info.cached_tokens, False)
        pinned = sum(info.tokens for info, _ in self.pins.values())
        if pinned + len(prompt_ids) > self.pin_limit:
            raise PinLimitExceeded(len(prompt_ids), pinned, self.pin_limit)
        cached = self._cached(list(prompt_ids) + [0], namespace)
        self.seen.setdefault(namespace, []).append(list(prompt_ids))
        info = PinInfo(f"pin-{uuid.uuid4().hex[:16]}", len(prompt_ids), namespace, cached)
        self.pins[info.pin_id] = (info, key)
        return info

    async def unpin(self, pin_id: str) -> PinInfo:
        if pin_id not in self.pins:
            raise UnknownPin(f"no pinned prefix has the id {pin_id!r}")
        return self.pins.pop(pin_id)[0]

    def pinned(self) -> list[PinInfo]:
        return [info for info, _ in self.pins.values()]

    def check_invariants(self) -> None:
        assert not self.live, f"live requests remain: {list(self.live)}"


def _satisfies_protocol(engine: FakeEngine) -> EngineClient:
    return engine               # mypy / pyright check this assignment
