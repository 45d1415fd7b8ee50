"""Server-sent events: the one streaming loop every streaming route uses.

Headers go out at once (after the engine accepted the request, so refusals still get
their own status code); while no output arrives — the request waits in the queue, or a
long prefill runs — a `: keep-alive` comment goes out every `keepalive_s`, so proxies with
short read timeouts keep the connection. OpenAI's framing: `data: {json}`, `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Protocol

import msgspec
from aiohttp import web

from radixserve.engine.outputs import RequestOutput

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


class NamedEvent(msgspec.Struct):
    """An event with a type line (`event: name`), as the Responses and Anthropic streams
    send them."""

    name: str
    data: Any


def event(body: Any) -> bytes:
    if isinstance(body, NamedEvent):
        return (b"event: " + body.name.encode() + b"\ndata: " + msgspec.json.encode(body.data)
                + b"\n\n")
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class EventSource(Protocol):
    """Turns a request's outputs into event bodies (OpenAI chunks, native events)."""

    stopped: bool                   # set when an output ended the stream early (an error)

    def on_output(self, out: RequestOutput) -> list[Any]: ...

    def abort_outputs(self) -> list[RequestOutput]:
        """Final 'abort' outputs for every sample not finished yet: what the engine would
        send after an abort, for when the server cannot wait for it (shutdown deadline)."""
        ...

    def closing(self) -> list[Any]:
        """Bodies after the last output (e.g. the usage chunk), unless stopped."""
        ...


async def stream_events(request: web.Request, outputs: AsyncIterator[RequestOutput],
                        source: EventSource, keepalive_s: float,
                        stop: asyncio.Event) -> web.StreamResponse:
    """Write `outputs` as SSE. A client that goes away raises out of `write` (or cancels
    this task); the caller's `run_on_engine` block then aborts the engine request. When
    the server sets `stop` (its shutdown grace is ending), the stream ends at once with
    the abort events the engine would have sent, without waiting for its step to end."""
    response = web.StreamResponse(headers=HEADERS)
    await response.prepare(request)
    pending: asyncio.Future | None = None
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while True:
            pending = asyncio.ensure_future(anext(outputs, None))
            while not (done := (await asyncio.wait({pending, stopping}, timeout=keepalive_s,
                                                   return_when=asyncio.FIRST_COMPLETED))[0]):
                await response.write(KEEPALIVE)
            if pending not in done:     # stopped by the server
                for out in source.abort_outputs():
                    for body in source.on_output(out):
                        await response.write(event(body))
                source.stopped = True
                break
            out, pending = pending.result(), None
            if out is None:
                break
            for body in source.on_output(out):
                await response.write(event(body))
            if source.stopped:
                break
        if not source.stopped:
            for body in source.closing():
                await response.write(event(body))
        await response.write(DONE)
    except ConnectionResetError:
        pass                        # client gone; leaving run_on_engine aborts the request
    finally:
        stopping.cancel()
        if pending is not None and not pending.done():
            pending.cancel()        # the outputs generator must be idle before it is closed
            await asyncio.wait({pending})
    return response
