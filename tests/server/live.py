"""A live radixserve HTTP server on 127.0.0.1 (any free port), in a background thread.

The server's event loop owns the engine; the test thread talks HTTP to it (the `openai`
client, aiohttp) and runs engine calls on that loop through `call`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

from radixserve.server.app import RunningServer, bound_address, drain_and_stop, start_server
from radixserve.server.engine_client import EngineClient
from radixserve.server.state import ServerConfig, ServerState


class LiveServer:
    def __init__(self, engine: EngineClient, config: ServerConfig | None = None):
        self.engine = engine
        self.config = config or ServerConfig(port=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.state: ServerState | None = None
        self.server: RunningServer | None = None
        self.url = ""

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        await self.engine.start()
        self.state = ServerState.create(self.engine, self.config)
        self.server = await start_server(self.state, "127.0.0.1", 0)
        host, port = bound_address(self.server)
        self.url = f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args):
        async def wrapper():
            return fn(*args)
        return self.run(wrapper())

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no request is served or held by the engine (aborts take a step to land)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.call(self.engine.stats)
            busy = self.call(lambda: (len(self.state.active), s.running, s.waiting))
            if busy == (0, 0, 0):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: active/running/waiting={busy}")
            time.sleep(0.02)

    def check_invariants(self) -> None:
        self.wait_idle()
        self.call(self.engine.check_invariants)

    def __exit__(self, *exc) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def drain(self, grace_s: float):
        """Start the server's shutdown drain; a future for its end."""
        self.drained = True
        return asyncio.run_coroutine_threadsafe(drain_and_stop(self.server, grace_s), self.loop)

    async def _stop(self) -> None:
        if not getattr(self, "drained", False):
            await drain_and_stop(self.server, grace_s=1.0)
        await self.engine.shutdown()
