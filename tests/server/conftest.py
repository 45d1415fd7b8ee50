"""Shared fixtures: the real default model, loaded once per session, and engines over it."""

from __future__ import annotations

import pytest

from radixserve.engine.config import EngineConfig

MODEL = "smollm2-135m-instruct"
DTYPE = "float32"          # fastest on CPU for a 135M model
MAX_MODEL_LEN = 2048
KV_CACHE_TOKENS = 16384


@pytest.fixture(scope="session")
def loaded_model():
    from radixserve.model import load_model
    return load_model(MODEL, dtype=DTYPE, device="cpu")


def engine_config(**overrides) -> EngineConfig:
    base = dict(model=MODEL, dtype=DTYPE, device="cpu", kv_cache_tokens=KV_CACHE_TOKENS,
                max_model_len=MAX_MODEL_LEN, max_running_requests=64, warmup_tokens=64)
    base.update(overrides)
    return EngineConfig(**base)


def make_engine(loaded, **overrides):
    from radixserve.engine.engine import Engine
    return Engine(engine_config(**overrides), loaded)
