"""Reading a request body under the server's limits: its size (413 by the declared
Content-Length before reading, or as soon as a chunked body passes the limit; the limit is
`--max-body-bytes`, by default derived from the context: body_limit.py), its time (408 for
a body that trickles in), and decoding a big one off the event loop. A 413's connection is
closed without reading the rest of the body (app.py). A client that sends
`Expect: 100-continue` is told "100 Continue" only when its declared length fits; otherwise
it gets the 413 before it sends a byte (`expect_continue`)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from aiohttp import web

from radixserve.server import protocol as P
from radixserve.server.body_limit import BodyLimit
from radixserve.server.errors import ApiError
from radixserve.server.state import STATE, error_response

T = TypeVar("T")
OFF_LOOP_BYTES = 256 * 1024     # bodies this big are decoded off the event loop (~1 ms of JSON)


def body_too_large(limit: BodyLimit) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit.bytes} bytes "
                         f"({limit.source})",
                    type="invalid_request_error", code="body_too_large")


def body_timeout(seconds: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {seconds:g} s",
                    type="invalid_request_error", code="request_timeout")


async def expect_continue(request: web.Request) -> web.Response | None:
    """Every POST route's `Expect` handler. aiohttp's default answers "100 Continue" to any
    body, before the route (and our size check) runs; this one refuses a declared length
    over the limit with the 413 first, so the client never sends the body. aiohttp calls it
    before the middlewares, so the responses are built here."""
    expect = request.headers.get("Expect", "").lower()
    if expect != "100-continue" or request.version < (1, 1):
        return error_response(ApiError(417, f"unsupported Expect header: {expect[:100]!r}",
                                       type="invalid_request_error", code="expectation_failed"))
    limit = request.app[STATE].body_limit
    if request.content_length is not None and request.content_length > limit.bytes:
        response = error_response(body_too_large(limit))
        response.force_close()          # nothing of the body was sent: nothing to read
        return response
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0      # as aiohttp's own handler: the reply starts after it
    return None


async def read_body(request: web.Request) -> bytes:
    """The whole body, or 413 / 408; a declared Content-Length over the limit is refused
    before reading a byte."""
    state = request.app[STATE]
    config, limit = state.config, state.body_limit
    if request.content_length is not None and request.content_length > limit.bytes:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(config.body_timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit.bytes:
                    raise body_too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timeout(config.body_timeout_s) from None
    return b"".join(chunks)


async def read_json(request: web.Request, type: type[T]) -> T:
    """The body decoded into a request struct (400 naming the field when it does not fit).
    A big body is decoded in a worker thread, off the loop's own frames; but msgspec holds
    the GIL for the whole call, so the loop and the compute thread wait for it either way:
    what bounds the pause is the decode's length (200,000 messages: 20-40 ms of CPU,
    measured, with no garbage collection since messages are untracked structs)."""
    body = await read_body(request)
    if len(body) < OFF_LOOP_BYTES:
        return P.decode(body, type)
    return await asyncio.to_thread(P.decode, body, type)
