"""`radixserve serve`: load the model, start the engine, serve HTTP until SIGTERM / SIGINT.

Start-up: load the model (dequantized weights come from the weights cache), build the
engine, listen (/health says 503 meanwhile), warm up, then /health says 200 and the
time of each phase is printed.

On a signal: stop accepting, let running requests finish within --shutdown-grace-s, abort
the rest, stop the engine, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from radixserve.engine.config import EngineConfig, add_engine_arguments
from radixserve.phase_timer import PhaseTimer
from radixserve.server.app import (DEFAULT_MAX_BODY_BYTES, STATE, ServerConfig, ServerState,
                                   bound_address, drain_and_stop, start_server)
from radixserve.server.auth import AuthConfig

API_KEY_ENV = "RADIXSERVE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0: any free port")
    g.add_argument("--api-key", action="append", default=None,
                   help=f"require 'Authorization: Bearer KEY' (repeat for several keys; "
                        f"also read from ${API_KEY_ENV})")
    g.add_argument("--namespace-per-api-key", action="store_true",
                   help="give each API key its own prefix-cache namespace")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: --model)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    g.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take before being aborted")
    g.add_argument("--retry-after-s", type=int, default=1,
                   help="Retry-After sent with 503 when the queue is full")
    g.add_argument("--access-log", action="store_true")
    add_engine_arguments(parser)


def server_config(args: argparse.Namespace) -> ServerConfig:
    keys = list(args.api_key or [])
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    if args.namespace_per_api_key and not keys:
        raise SystemExit("--namespace-per-api-key needs at least one --api-key")
    return ServerConfig(host=args.host, port=args.port,
                        auth=AuthConfig(tuple(keys), args.namespace_per_api_key),
                        max_body_bytes=args.max_body_bytes,
                        shutdown_grace_s=args.shutdown_grace_s,
                        served_model_name=args.served_model_name,
                        retry_after_s=args.retry_after_s, access_log=args.access_log)


def describe_pool(engine) -> str:
    s = engine.stats()
    tokens = s.pages_total * s.page_size
    size = s.kv_pool_bytes
    return (f"KV pool: {tokens} tokens ({s.pages_total} pages of {s.page_size}), "
            f"{size / 2**20:.1f} MiB ({size} bytes)")


async def start_serving(engine, config: ServerConfig, timer: PhaseTimer) -> web.AppRunner:
    """Listen first, then warm the engine up: /health answers 503 until `engine.start`
    returns (warm-up done, loop running), 200 from then on."""
    state = ServerState.create(engine, config)
    runner = await start_server(state, config.host, config.port)
    timer.lap("listen")
    try:
        await engine.start()
    except BaseException:
        await runner.cleanup()
        raise
    timer.lap("warm-up")
    return runner


async def serve(engine_config: EngineConfig, config: ServerConfig, timer: PhaseTimer) -> None:
    from radixserve.engine.engine import Engine
    from radixserve.engine.model_loading import load_engine_model

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    timer.lap("python and imports")
    loaded = load_engine_model(engine_config, timer)
    engine = Engine(engine_config, loaded)
    timer.lap("engine and KV pool")
    runner = await start_serving(engine, config, timer)
    state = runner.app[STATE]
    host, port = bound_address(runner)
    print(f"radixserve: serving {state.info.name!r} on http://{host}:{port} "
          f"(context {state.info.max_model_len} tokens)", flush=True)
    print(f"radixserve: {describe_pool(engine)}", flush=True)
    print(f"radixserve: {timer.summary()}", flush=True)
    print(f"radixserve: {engine.runner.describe_kv_cache()}", flush=True)
    try:
        await stop.wait()
        print("radixserve: shutting down", flush=True)
        await drain_and_stop(runner, state, config.shutdown_grace_s)
    finally:
        await engine.shutdown()
    print("radixserve: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    timer = PhaseTimer.since_process_start()
    logging.basicConfig(level=logging.INFO if args.access_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = server_config(args)
    try:
        asyncio.run(serve(EngineConfig.from_args(args), config, timer))
    except KeyboardInterrupt:
        pass
    except Exception as exc:                     # ModelLoadError and friends: say it plainly
        from radixserve.model import ModelLoadError
        if isinstance(exc, ModelLoadError):
            print(f"radixserve: {exc}", file=sys.stderr)
            return 1
        raise
    return 0
