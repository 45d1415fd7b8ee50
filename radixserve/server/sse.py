"""Server-sent events: the framing OpenAI clients expect (`data: {json}\n\n`, `data: [DONE]`)."""

from __future__ import annotations

import msgspec
from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def event(body) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers=HEADERS)
    await response.prepare(request)
    return response
