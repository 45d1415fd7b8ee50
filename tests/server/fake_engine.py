"""A small engine that follows the Engine contract (docs/contracts.md) without a model.

Used for protocol-shape and routing tests that need exact control (token timing, queue
capacity, logprobs). The Show tests run against the real engine instead.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from radixserve.engine.config import EngineConfig
from radixserve.engine.errors import CacheBusy, EngineStopped, InvalidRequest, QueueFull
from radixserve.engine.outputs import EngineStats, RequestOutput, TokenLogprob, Usage
from radixserve.engine.sampling_params import SamplingParams

EOS = 256


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS."""

    vocab_size = 260
    eos_token_ids = frozenset({EOS})
    bos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt=True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


@dataclass
class _Live:
    aborted: bool = False


class FakeEngine:
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
        self._stats = EngineStats(pages_total=1024, page_size=1)
        self._stats.kv_pool_bytes = 1024 * 100

    @property
    def ready(self) -> bool:
        return not self.stopped

    async def start(self) -> None:
        self.stopped = False

    async def shutdown(self, grace_s: float = 0) -> None:
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
        params.validate(self.tokenizer.vocab_size)
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
            raise InvalidRequest("input_ids", "out of vocabulary")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", "too long")
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
        self._stats.running = len(self.live)
        return self._stats

    def flush_cache(self) -> None:
        if self.live:
            raise CacheBusy("busy")
        self.seen.clear()

    def check_invariants(self) -> None:
        assert not self.live, f"live requests remain: {list(self.live)}"
