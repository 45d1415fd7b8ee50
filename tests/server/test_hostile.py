"""Hostile input against one live server on the real engine (loopback only, every wait
bounded by the server's own short timeouts): nested JSON, a 5 MB prompt, 200,000
messages, invalid UTF-8, slow and incomplete bodies, half-open connections, absurd
parameters, wrong content types, a connection flood. Each gets its 4xx in OpenAI's shape
(or, with no request to answer, a closed connection), nothing logs a traceback, and a
probe stream beside them keeps streaming: its longest chunk gap, the process's RSS and
page conservation are asserted."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.conftest import make_engine
from tests.server.hostile import (HELD, Probe, hostile_cases, open_idle_connections, rss_bytes,
                                  run_case)
from tests.server.live import LiveServer

TIMEOUT_S = 2.0          # header and body timeouts: how long a slow client may hold a slot
HELD_AT_MOST_S = 60.0    # far past the timeouts (plus 1 s lingering), far below "forever"
MAX_CONNECTIONS = 64
ROUNDS = 3
GAP_MARGIN_S = 0.3       # issue 20's target: no stall longer than this beyond a normal step
# A busy box stretches every step, the mix's too: the longest gap may be this many times the
# baseline stream's longest (seen: 0.51 -> 1.41 s and 0.91 -> 1.95 s at load 15-18, every
# status right). The stall this guards against was seconds to tens of seconds (the loop
# reading 5 MB bodies); the idle figure is bench_hostile.py's, not this test's.
GAP_STRETCH = 3.0
RSS_GROWTH = 1.10        # RSS after the refused requests within 10% of before


@pytest.fixture(scope="module")
def server(loaded_model):
    config = ServerConfig(port=0, header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S,
                          max_connections=MAX_CONNECTIONS)
    with LiveServer(make_engine(loaded_model), config) as srv:
        yield srv


def no_tracebacks(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.exc_info or r.levelno >= logging.ERROR]


def pool_conserved(server) -> None:
    server.check_invariants()
    pool = http.get(server.url + "/cache/stats").json()["pool"]
    assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]
    assert pool["pages_private"] == 0


def test_hostile_mix_is_refused_while_a_probe_streams(server, caplog):
    caplog.set_level(logging.WARNING)
    cases = hostile_cases()                         # built before measuring anything
    probe = Probe(server.url).start()
    try:
        assert probe.streamed.wait(300)             # one whole stream: the baseline
        baseline_gap = probe.longest_gap
        gaps_before = len(probe.gaps)
        rss_before = rss_bytes()
        rss_curve = []
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(len(cases)) as pool:
                outcomes = list(pool.map(lambda case: run_case(server.url, case), cases))
            for case, out in zip(cases, outcomes):
                assert out.status == case.expect, (case.name, out.status, out.body[:300])
                if case.expect in (408, None):   # the connection is not held past the timeouts
                    assert out.body != HELD and out.seconds < HELD_AT_MOST_S, (case.name, out.seconds)
                if case.expect is not None:
                    error = out.error()
                    assert error is not None and set(error) == {"message", "type", "param", "code"}
                    assert len(out.body) < 2048, (case.name, len(out.body))   # values cut
            rss_curve.append(rss_bytes())
        gaps_during = len(probe.gaps) - gaps_before
    finally:
        probe.stop()
    print(f"probe: baseline gap {baseline_gap:.3f} s, longest {probe.longest_gap:.3f} s; "
          f"RSS {rss_before / 2**20:.0f} MiB -> {[round(r / 2**20) for r in rss_curve]} MiB")
    assert probe.failures == []
    assert gaps_during > 0                          # the probe streamed through the mix
    assert probe.longest_gap < GAP_STRETCH * baseline_gap + GAP_MARGIN_S, \
        (probe.longest_gap, baseline_gap)
    assert max(rss_curve) <= rss_before * RSS_GROWTH, (rss_before, rss_curve)
    assert no_tracebacks(caplog) == []
    pool_conserved(server)


def test_connection_flood_is_bounded(server, caplog):
    caplog.set_level(logging.WARNING)
    outcomes = open_idle_connections(server.url, 200)
    refused = [o for o in outcomes if o.status == 503]
    closed = [o for o in outcomes if o.status is None]
    assert len(refused) + len(closed) == 200
    assert len(refused) >= 200 - MAX_CONNECTIONS
    assert all(o.error()["code"] == "too_many_connections" for o in refused)
    # the idle ones were closed by the header timeout; the server serves again
    r = http.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status == 200
    assert no_tracebacks(caplog) == []
    pool_conserved(server)
