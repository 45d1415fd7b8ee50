"""Start-up: the server listens before the warm-up and says 503 on /health until the engine
can serve; the KV pool costs no memory until used."""

from __future__ import annotations

import asyncio
import socket
import threading

import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.phase_timer import PhaseTimer
from radixserve.server.app import drain_and_stop
from radixserve.server.state import ServerConfig
from radixserve.server.cli import start_serving
from tests.server import http
from tests.server.conftest import make_engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str) -> http.Reply:
    return http.post(url + "/v1/completions",
                     json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})


def test_health_is_503_until_the_warm_up_is_done(loaded_model):
    """The warm-up is held on an event: while it runs, the server already answers, and
    /health and the API say 503; once `start_serving` returns, /health says 200 and a
    request is served at once."""
    engine = make_engine(loaded_model)
    warming, release = threading.Event(), threading.Event()
    real_warm_up = engine.runner.warm_up

    def held_warm_up(*args):
        warming.set()
        assert release.wait(120), "test never released the warm-up"
        real_warm_up(*args)

    engine.runner.warm_up = held_warm_up
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    timer = PhaseTimer()
    url = f"http://127.0.0.1:{port}"
    started = asyncio.run_coroutine_threadsafe(
        start_serving(engine, ServerConfig(port=port), timer), loop)
    server = None
    try:
        assert warming.wait(120)                   # listening, warm-up in progress
        for _ in range(3):
            reply = http.get(url + "/health")
            assert reply.status == 503 and reply.json()["error"]["code"] == "starting"
        refused = complete(url)
        assert refused.status == 503 and refused.json()["error"]["code"] == "starting"
        assert not engine.ready and not started.done()

        release.set()
        server = started.result(120)
        assert engine.ready
        assert http.get(url + "/health").json() == {"status": "ok"}
        served = complete(url)
        assert served.status == 200 and served.json()["choices"][0]["text"]
        assert [name for name, _ in timer.phases] == ["listen", "warm-up"]
    finally:
        release.set()
        if server is None:
            server = started.result(120)
        asyncio.run_coroutine_threadsafe(drain_and_stop(server, 5.0), loop).result(60)
        asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert not engine.ready


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_cpu_pool_takes_memory_only_where_written():
    """1 GiB of pool: zero everywhere, yet resident memory grows by the touched pages only
    (torch.zeros would write, and so make resident, every byte)."""
    before = resident_bytes()
    pool = KVPool(num_layers=4, num_pages=1 << 15, page_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16, device="cpu")
    assert pool.total_bytes == 1 << 30
    grown = resident_bytes() - before
    assert grown < 64 << 20, f"allocating the pool made {grown >> 20} MiB resident"
    slots = torch.tensor([0, 12345, pool.num_slots - 1])
    assert not pool.k_flat[3][slots].any() and not pool.v_flat[0][slots].any()
    k = torch.ones(3, 2, 64, dtype=torch.bfloat16)
    pool.write(3, slots, k, -k)
    assert torch.equal(pool.k_flat[3][slots], k) and torch.equal(pool.v_flat[3][slots], -k)
    assert not pool.k_flat[2][slots].any()
