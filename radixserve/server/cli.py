"""`radixserve serve`: load the model, start the engine, serve HTTP until SIGTERM / SIGINT.

Start-up: load the model (dequantized weights come from the weights cache), build the
engine, listen (/health says 503 meanwhile), warm up, then /health says 200 and the
time of each phase is printed.

On a signal: stop accepting, let running requests finish, abort the rest, stop the engine
and exit 0, all within --shutdown-grace-s. A second signal exits at once (status 128 +
the signal's number), for an operator who does not want to wait.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time

from radixserve.cluster.options import (ClusterOptions, add_cluster_arguments, cluster_options,
                                        import_launch)
from radixserve.engine.config import EngineConfig, add_engine_arguments
from radixserve.phase_timer import PhaseTimer
from radixserve.server.app import RunningServer, bound_address, drain_and_stop, start_server
from radixserve.server.auth import AuthConfig
from radixserve.server.conversations import ConversationConfig
from radixserve.server.body_limit import AUTO, parse_max_body_bytes
from radixserve.server.state import ServerConfig, ServerState

API_KEY_ENV = "RADIXSERVE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0: any free port")
    g.add_argument("--api-key", action="append", default=None,
                   help=f"require 'Authorization: Bearer KEY' (repeat for several keys; "
                        f"also read from ${API_KEY_ENV})")
    g.add_argument("--admin-api-key", action="append", default=None,
                   help="a key that may also flush the whole cache and read every tenant's "
                        "cache counters (repeatable); tenant keys act on their own namespace")
    g.add_argument("--namespace-per-api-key", action="store_true",
                   help="give each API key its own prefix-cache namespace")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: --model)")
    defaults = ServerConfig()
    g.add_argument("--max-body-bytes", type=parse_max_body_bytes, default=AUTO,
                   help="larger request bodies get 413, by their declared length before a "
                        "byte is read, or as soon as the limit is passed (auto: 1 MiB + 64 "
                        "bytes per token of the context)")
    g.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                   help="a connection that has not sent a request's headers this long after "
                        "opening (or after its previous response) is closed")
    g.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s,
                   help="a request body that has not fully arrived after this long gets 408")
    g.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="open connections beyond this are answered 503 and closed")
    g.add_argument("--sse-keepalive-s", type=float, default=defaults.sse_keepalive_s,
                   help="a stream with no new token for this long gets a ': keep-alive' comment")
    g.add_argument("--allowed-origin", action="append", default=None,
                   help="a web origin (scheme://host:port) whose pages may POST here "
                        "(repeatable; same-origin pages always may, others get 403)")
    g.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take before being aborted")
    g.add_argument("--retry-after-s", type=int, default=1,
                   help="Retry-After sent with 503 when the queue is full")
    g.add_argument("--access-log", action="store_true")
    g.add_argument("--ui-show-text", action="store_true",
                   help="the cache view (/ui, /cache/tree) shows token text, to each caller "
                        "for its own namespace only (default: prefixes named by hash)")
    add_conversation_arguments(parser)
    add_engine_arguments(parser)
    add_cluster_arguments(parser)


# `serve` compiles the lone decode step unless told not to; the environment variable lets a
# test suite (tests/conftest.py sets it to off) start servers without background compiles.
DECODE_COMPILE_ENV = "RADIXSERVE_DECODE_COMPILE"


def serve_decode_compile(args: argparse.Namespace) -> str:
    """`serve`'s --decode-compile: the flag, else $RADIXSERVE_DECODE_COMPILE, else auto (a
    cold cache compiles niced in the background while the server serves eagerly; other
    commands and in-process engines keep EngineConfig's off)."""
    return args.decode_compile or os.environ.get(DECODE_COMPILE_ENV) or "auto"


def server_config(args: argparse.Namespace) -> ServerConfig:
    keys = list(args.api_key or [])
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    admin_keys = tuple(args.admin_api_key or [])
    if args.namespace_per_api_key and not keys:
        raise SystemExit("--namespace-per-api-key needs at least one --api-key")
    return ServerConfig(host=args.host, port=args.port,
                        auth=AuthConfig(tuple(keys), args.namespace_per_api_key, admin_keys),
                        max_body_bytes=args.max_body_bytes,
                        header_timeout_s=args.header_timeout_s,
                        body_timeout_s=args.body_timeout_s,
                        max_connections=args.max_connections,
                        sse_keepalive_s=args.sse_keepalive_s,
                        allowed_origins=tuple(args.allowed_origin or []),
                        shutdown_grace_s=args.shutdown_grace_s,
                        served_model_name=args.served_model_name,
                        retry_after_s=args.retry_after_s, access_log=args.access_log,
                        ui_show_text=args.ui_show_text,
                        conversations=conversation_config(args))


def add_conversation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stored responses (/v1/responses, docs/conversations.md)")
    d = ConversationConfig()
    g.add_argument("--response-max-stored", type=int, default=d.max_responses,
                   help="stored responses kept at most (least recently used dropped first)")
    g.add_argument("--response-max-tokens", type=int, default=d.max_tokens,
                   help="token ids all stored responses may hold together")
    g.add_argument("--response-ttl-s", type=float, default=d.ttl_s,
                   help="a stored response unused this long is dropped (its id answers 404)")
    g.add_argument("--response-pin-ttl-s", type=float, default=d.pin_ttl_s,
                   help="a stored response's tokens stay pinned in the KV pool this long after "
                        "its last use (0: no pins; an unpinned history is recomputed)")
    g.add_argument("--response-pin-tokens", type=int, default=None,
                   help="tokens those pins may hold together (default: --max-pinned-tokens)")
    g.add_argument("--cache-control-pin-tokens", type=int, default=None,
                   help="tokens the pins of /v1/messages cache_control breakpoints may hold "
                        "together; a breakpoint beyond it is a 400 (default: "
                        "--max-pinned-tokens)")


def conversation_config(args: argparse.Namespace) -> ConversationConfig:
    return ConversationConfig(max_responses=args.response_max_stored,
                              max_tokens=args.response_max_tokens, ttl_s=args.response_ttl_s,
                              pin_ttl_s=args.response_pin_ttl_s,
                              pin_tokens=args.response_pin_tokens,
                              cache_control_pin_tokens=args.cache_control_pin_tokens)


def describe_pool(engine) -> str:
    s = engine.stats()
    tokens = s.pages_total * s.page_size
    size = s.kv_pool_bytes
    return (f"KV pool: {tokens} tokens ({s.pages_total} pages of {s.page_size}), "
            f"{size / 2**20:.1f} MiB ({size} bytes)")


async def start_serving(engine, config: ServerConfig, timer: PhaseTimer) -> RunningServer:
    """Listen first, then warm the engine up: /health answers 503 until `engine.start`
    returns (warm-up done, loop running), 200 from then on."""
    state = ServerState.create(engine, config)
    server = await start_server(state, config.host, config.port)
    timer.lap("listen")
    try:
        await engine.start()
    except BaseException:
        await server.runner.cleanup()
        raise
    timer.lap("warm-up")
    return server


def freeze_startup_heap() -> None:
    """Move everything alive after warm-up (model, tokenizer, imports: ~450,000 tracked objects)
    out of the collector's reach: a full collection then walks only what requests made,
    instead of holding the GIL for 0.3-0.7 s over the startup heap while streams wait
    (measured for issue 39 while big bodies arrived)."""
    gc.collect()
    gc.freeze()


async def serve(engine_config: EngineConfig, config: ServerConfig, timer: PhaseTimer,
                cluster: ClusterOptions | None = None) -> None:
    from radixserve.engine.engine import Engine
    from radixserve.engine.model_loading import load_engine_model

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig, stop)
    timer.lap("python and imports")
    if cluster is None:
        loaded = load_engine_model(engine_config, timer)
        engine = Engine(engine_config, loaded)
        timer.lap("engine and KV pool")
    else:                       # --replicas N: a RayEngineClient in front of Ray Serve replicas
        engine = await import_launch().start_client(engine_config, cluster)
        timer.lap("replicas on Ray Serve")
    server = await start_serving(engine, config, timer)
    freeze_startup_heap()
    state = server.state
    host, port = bound_address(server)
    print(f"radixserve: serving {state.info.name!r} on http://{host}:{port} "
          f"(context {state.info.max_model_len} tokens)", flush=True)
    print(f"radixserve: request bodies up to {state.body_limit.bytes} bytes "
          f"({state.body_limit.source})", flush=True)
    print(f"radixserve: {describe_pool(engine)}", flush=True)
    disk = engine.stats().kv_disk
    if disk is not None:
        print(f"radixserve: KV disk store {disk.dir}: restored {disk.restored_tokens} "
              f"tokens, {disk.pages} pages on disk", flush=True)
    print(f"radixserve: {timer.summary()}", flush=True)
    print(f"radixserve: cache view on http://{host}:{port}/ui", flush=True)
    for line in (engine.describe_kv_cache(), engine.describe_weights()):
        if line is not None:                      # None: replicas behind Ray Serve
            print(f"radixserve: {line}", flush=True)
    compiled = getattr(getattr(engine, "runner", None), "compiled_decode", None)
    if compiled is not None:                      # --decode-compile
        print(f"radixserve: {compiled.describe()}", flush=True)
    save_by = None              # with a disk store, the last half of the grace is the save's
    try:
        await stop.wait()
        started = time.monotonic()
        print("radixserve: shutting down", flush=True)
        grace = config.shutdown_grace_s
        if engine.stats().kv_disk is not None:
            save_by, grace = started + grace, grace / 2
        await drain_and_stop(server, grace)
        drained = time.monotonic()
    finally:
        await engine.shutdown(save_by=save_by)
    print(f"radixserve: stopped (drain {drained - started:.2f} s, "
          f"engine {time.monotonic() - drained:.2f} s)", flush=True)


def on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    """The first signal starts a graceful stop; a second one exits at once."""
    if not stop.is_set():
        stop.set()
        return
    print(f"radixserve: second {sig.name}: exiting now", file=sys.stderr, flush=True)
    os._exit(128 + sig)


def run(args: argparse.Namespace) -> int:
    timer = PhaseTimer.since_process_start()
    logging.basicConfig(level=logging.INFO if args.access_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # --decode-compile: when the background compile ends and the compiled step takes over
    logging.getLogger("radixserve.model.compiled_decode").setLevel(logging.INFO)
    config = server_config(args)
    cluster = cluster_options(args)
    if cluster is not None:
        import_launch()         # without Ray: one line naming the extra, before any loading
    try:
        args.decode_compile = serve_decode_compile(args)
        asyncio.run(serve(EngineConfig.from_args(args), config, timer, cluster))
    except KeyboardInterrupt:
        pass
    except Exception as exc:                     # ModelLoadError and friends: say it plainly
        from radixserve.model import ModelLoadError
        if isinstance(exc, ModelLoadError):
            print(f"radixserve: {exc}", file=sys.stderr)
            return 1
        raise
    return 0
