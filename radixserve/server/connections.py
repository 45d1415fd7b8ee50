"""The listening socket, with a limit on open connections.

Every connection holds a file descriptor and a protocol object, so without a limit a
client that opens thousands (and sends nothing) exhausts the process. Past
`max_connections`, a new connection is answered at once with a 503 in OpenAI's shape and
closed. Idle and half-open connections are closed by aiohttp's keep-alive timer, which
also runs from the moment a connection opens (`--header-timeout-s`).
"""

from __future__ import annotations

import asyncio
from typing import Callable

import msgspec
from aiohttp import web

from radixserve.server.errors import ApiError


def _refusal(retry_after_s: int) -> bytes:
    body = msgspec.json.encode(ApiError(
        503, "too many open connections; retry later", type="service_unavailable",
        code="too_many_connections").body())
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\n"
            f"Connection: close\r\n\r\n")
    return head.encode() + body


class _Refused(asyncio.Protocol):
    def __init__(self, reply: bytes):
        self.reply = reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.reply)             # type: ignore[attr-defined]
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted until the connection is lost."""

    def __init__(self, inner: asyncio.Protocol, on_lost: Callable[[], None]):
        self.inner = inner
        self.on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self.inner.connection_lost(exc)
        finally:
            self.on_lost()


class LimitedSite(web.BaseSite):
    """Like aiohttp's TCPSite, but with at most `max_connections` open connections."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int,
                 retry_after_s: int = 1):
        super().__init__(runner)
        self._host = host
        self._port = port
        self.max_connections = max_connections
        self.open_connections = 0
        self._reply = _refusal(retry_after_s)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def _lost(self) -> None:
        self.open_connections -= 1

    def _protocol(self) -> asyncio.Protocol:
        if self.open_connections >= self.max_connections:
            return _Refused(self._reply)
        handler = self._runner.server
        assert handler is not None, "the runner is not set up"
        self.open_connections += 1          # counted from creation: accepts come in bursts
        return _Counted(handler(), self._lost)

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port,
                                                reuse_address=True)
