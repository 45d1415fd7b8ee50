"""`radixserve batch INPUT.jsonl OUTPUT.jsonl`: an OpenAI-format batch file, run offline.

Few-shot jobs repeat one long preamble across many requests. Everything is tokenized
first and the work is ordered by token ids, so requests sharing a preamble run next to
each other: the first computes it, the rest hit it in the radix cache (the engine's lpm
policy and insert-after-each-chunk do the rest). Results are written in input order.

Imports no aiohttp: bodies are validated and rendered by the same code the server uses.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any, Awaitable, Callable

import msgspec
from tqdm import tqdm

from radixserve.engine.config import EngineConfig, add_engine_arguments
from radixserve.server import protocol as P
from radixserve.server.errors import ApiError, api_error_from
from radixserve.server.engine_client import EngineClient
from radixserve.server.openai_serving import (ChatRenderer, CompletionRenderer, Renderer,
                                              run_to_response)
from radixserve.server.prompts import (ModelInfo, Prepared, PromptBuilder, model_info,
                                       prepare_chat, prepare_completion)



@dataclass(frozen=True)
class Endpoint:
    """What a batch line's URL selects: its body's type, how it is prepared, its renderer."""

    request_type: type
    prepare: Callable[..., Awaitable[Prepared]]
    renderer: type[Renderer]


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(P.ChatCompletionRequest, prepare_chat, ChatRenderer),
    "/v1/completions": Endpoint(P.CompletionRequest, prepare_completion, CompletionRenderer),
}
QUEUE_FULL_RETRY_S = 0.05


class BatchLine(msgspec.Struct, kw_only=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class BatchResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: Any


class BatchError(msgspec.Struct):
    code: str
    message: str


class BatchResult(msgspec.Struct):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


@dataclass
class Item:
    """One input line: either ready to run, or already answered (an error)."""

    index: int
    custom_id: str | None
    endpoint: Endpoint | None = None
    prepared: Prepared | None = None
    result: BatchResult | None = None


def _result(custom_id: str | None, response: BatchResponse | None = None,
            error: BatchError | None = None) -> BatchResult:
    return BatchResult("batch_req_" + uuid.uuid4().hex, custom_id, response, error)


def api_error_result(custom_id: str | None, err: ApiError) -> BatchResult:
    """A request the server would have refused: its HTTP status and error body."""
    return _result(custom_id, BatchResponse(err.status, "req_" + uuid.uuid4().hex, err.body()))


async def parse_line(index: int, line: bytes, prompts: PromptBuilder, seen: set[str]) -> Item:
    """Decode, validate and tokenize one line. Malformed lines answer with `error` set;
    valid lines with an invalid body answer with the 4xx the server would send."""
    try:
        entry = msgspec.json.decode(line, type=BatchLine)
    except msgspec.DecodeError as exc:
        custom_id = _salvage_custom_id(line)
        return Item(index, custom_id, result=_result(custom_id, error=BatchError(
            "invalid_line", f"line {index + 1}: not a valid batch request line: {exc}")))
    item = Item(index, entry.custom_id)
    if entry.custom_id in seen:
        item.result = _result(entry.custom_id, error=BatchError(
            "duplicate_custom_id", f"line {index + 1}: custom_id {entry.custom_id!r} repeats an earlier line"))
        return item
    seen.add(entry.custom_id)
    if entry.method.upper() != "POST" or entry.url not in ENDPOINTS:
        item.result = _result(entry.custom_id, error=BatchError(
            "invalid_url", f"line {index + 1}: {entry.method} {entry.url} is not supported; "
                           f"use POST {' or POST '.join(ENDPOINTS)}"))
        return item
    item.endpoint = endpoint = ENDPOINTS[entry.url]
    try:
        req = P.decode(entry.body, endpoint.request_type)
        item.prepared = await endpoint.prepare(req, prompts, strict_model=False)
    except ApiError as err:
        item.result = api_error_result(entry.custom_id, err)
    return item


def _salvage_custom_id(line: bytes) -> str | None:
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def work_order(items: list[Item]) -> list[Item]:
    """Runnable items sorted by (namespace, token ids): shared prefixes become neighbours."""
    runnable = [it for it in items if it.prepared is not None]
    return sorted(runnable, key=lambda it: (it.prepared.namespace or "", it.prepared.prompt_ids))


async def run_item(engine: EngineClient, info: ModelInfo, item: Item) -> BatchResult:
    while True:
        renderer = item.endpoint.renderer(info.name, item.prepared, engine.tokenizer)
        request_id = "req_" + uuid.uuid4().hex
        try:
            body = await run_to_response(engine, renderer, request_id=request_id)
        except Exception as exc:     # noqa: BLE001 - one failed request is one error line
            err = api_error_from(exc)
            if err.code == "queue_full":
                await asyncio.sleep(QUEUE_FULL_RETRY_S)
                continue
            return api_error_result(item.custom_id, err)
        return _result(item.custom_id, BatchResponse(200, request_id, body))


class OrderedWriter:
    """Writes results in input order as soon as every earlier one is known."""

    def __init__(self, out: IO[bytes], items: list[Item]):
        self.out = out
        self.items = items
        self.next = 0

    def flush_ready(self) -> None:
        while self.next < len(self.items) and self.items[self.next].result is not None:
            self.out.write(msgspec.json.encode(self.items[self.next].result) + b"\n")
            self.next += 1
        self.out.flush()


@dataclass
class Summary:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, result: BatchResult) -> None:
        self.requests += 1
        if result.response is None or result.response.status_code != 200:
            self.errors += 1
            return
        usage = result.response.body.usage
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.prompt_tokens_details.cached_tokens
        self.completion_tokens += usage.completion_tokens

    def line(self) -> str:
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return (f"{self.requests} requests ({self.errors} errors) in {self.seconds:.1f} s; "
                f"prompt tokens {self.prompt_tokens}, cached {self.cached_tokens} ({hit:.0%}); "
                f"generated {self.completion_tokens}")


async def run_batch(engine: EngineClient, lines: list[bytes], out: IO[bytes], *, concurrency: int,
                    progress: bool = True, info: ModelInfo | None = None) -> Summary:
    """Run every line through a started engine; write one result per line to `out`."""
    t0 = time.perf_counter()
    info = info or model_info(engine)
    seen: set[str] = set()
    prompts = PromptBuilder(engine.tokenizer, info)
    try:
        items = [await parse_line(i, line, prompts, seen) for i, line in enumerate(lines)]
    finally:
        prompts.close()
    writer = OrderedWriter(out, items)
    summary = Summary()
    bar = tqdm(total=len(items), unit="req", disable=not progress, file=sys.stderr)
    for it in items:
        if it.result is not None:
            summary.add(it.result)
            bar.update(1)
    writer.flush_ready()
    order = iter(work_order(items))

    async def worker() -> None:
        for item in order:            # a shared iterator: workers take items in sorted order
            item.result = await run_item(engine, info, item)
            summary.add(item.result)
            bar.update(1)
            writer.flush_ready()

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    writer.flush_ready()
    bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL file: one {custom_id, method, url, body} per line")
    parser.add_argument("output", help="JSONL file to write: one result per input line, in order")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight (default: 2 x --max-running-requests)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_arguments(parser)


async def _main(config: EngineConfig, args: argparse.Namespace, lines: list[bytes]) -> Summary:
    from radixserve.engine.engine import Engine
    from radixserve.engine.model_loading import load_engine_model

    loaded = load_engine_model(config)
    engine = Engine(config, loaded)
    await engine.start()
    try:
        concurrency = args.max_concurrency or 2 * config.max_running_requests
        with open(args.output, "wb") as out:
            return await run_batch(engine, lines, out, concurrency=concurrency,
                                   progress=not args.quiet)
    finally:
        await engine.shutdown()


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.input, "rb") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError as exc:
        print(f"radixserve batch: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    summary = asyncio.run(_main(EngineConfig.from_args(args), args, lines))
    print(f"radixserve batch: {summary.line()}", file=sys.stderr)
    return 0
