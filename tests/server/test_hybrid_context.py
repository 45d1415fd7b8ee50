"""A hybrid (Gemma 3) model served: a prompt longer than the model's context is a 400
naming `prompt`, a prompt far past the sliding window is served, and the server keeps
serving with every KV page accounted for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from tests.server import http
from tests.server.live import LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hybrid_models import WINDOW, build_family  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    family = build_family("gemma3", tmp_path_factory.mktemp("served-gemma3"))
    config = EngineConfig(model=str(family.directory), dtype="float32", device="cpu",
                          kv_cache_tokens=4096, warmup_tokens=0, page_size=4)
    with LiveServer(Engine(config, family.loaded)) as srv:
        yield srv, family


def test_prompt_longer_than_context_is_400(server):
    srv, family = server
    context = family.loaded.config.max_position_embeddings
    r = http.post(srv.url + "/v1/completions",
                  json={"prompt": [5] * (context + 1), "max_tokens": 2})
    assert r.status == 400, r.body
    error = r.json()["error"]
    assert error["param"] == "prompt" and str(context) in error["message"]
    # Far past the window (W = 16) but inside the context: served.
    ok = http.post(srv.url + "/v1/completions",
                   json={"prompt": [7, 8, 9] * (4 * WINDOW), "max_tokens": 4})
    assert ok.status == 200, ok.body
    assert ok.json()["usage"]["completion_tokens"] == 4
    srv.wait_idle()
    srv.check_invariants()
