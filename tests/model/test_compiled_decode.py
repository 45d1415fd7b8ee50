"""--decode-compile: the lone decode through the AOTInductor-compiled step (a tiny random
2-layer Llama, int4 weights in a float32 model, as served on this CPU class).

One compile for the module (the fixture, ~20-40 s: a C++ build). It runs as in a server
on a cold cache: the engine serves eagerly while a child process compiles, then switches.
Every later engine of the module finds the artefact in the cache and loads it (no compile).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from radixserve.engine.sampling_params import SamplingParams
from radixserve.model import compiled_decode, load_model
from radixserve.model.compiled_decode import CompiledDecode, DecodeCompileError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import check_pages, collect, make_engine, run_scenario  # noqa: E402
from tiny_models import hf_config, random_hf_model, save_hf_dir  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
PROMPTS = [[7, 30, 41, 99, 5, 61, 200, 3], [150, 2, 2, 80, 33], list(range(40, 100))]
LOGPROB_ATOL = 1e-4       # fp32 logits: fused kernels sum in another order (~1e-6 seen)


def one_at_a_time(prompts):
    """Each prompt alone (every decode step a lone decode): tokens and logprobs."""
    async def scenario(engine):
        out = []
        for p in prompts:
            got = await collect(engine.generate(p, GREEDY))
            out.append((got.token_ids[0], [lp.logprob for lp in got.final.logprobs or []]))
        return out
    return scenario


def engine_on(loaded, cache: Path, **kw):
    return make_engine(loaded, decode_compile="on", weights_cache_dir=str(cache), **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = save_hf_dir(tmp_path_factory.mktemp("tiny-llama"),
                            random_hf_model(hf_config("llama")))
    return load_model(str(directory), dtype="float32", weights_dtype="int4")


@pytest.fixture(scope="module")
def expected(tiny):
    """Greedy tokens and logprobs of the eager step."""
    return run_scenario(make_engine(tiny), one_at_a_time(PROMPTS))


@pytest.fixture(scope="module")
def cache(tiny, expected, tmp_path_factory):
    """A weights cache dir holding the compiled step, built the way a server builds it
    (the child's C++ wrapper at -O0, torch's own knob: ~2x quicker to build)."""
    root = tmp_path_factory.mktemp("compiled-cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
        engine = engine_on(tiny, root)
    compiled = engine.runner.compiled_decode

    async def scenario(engine):
        # Serving starts at once, eagerly, while the child compiles.
        assert compiled.stats.state == "compiling" and not compiled.ready
        first = await collect(engine.generate(PROMPTS[0], GREEDY))
        assert first.token_ids[0] == expected[0][0]
        await asyncio.to_thread(compiled.wait_for_compile)   # its end, not a guess
        return await one_at_a_time(PROMPTS)(engine)

    got = run_scenario(engine, scenario)
    s = compiled.stats
    assert (s.state, s.compiles_started, s.loads) == ("ready", 1, 1), s
    assert s.compiled_steps > 0
    assert_same(got, expected)
    return root


def assert_same(got, expected) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= LOGPROB_ATOL


def test_a_cached_step_is_loaded_without_compiling_and_equals_eager(tiny, expected, cache):
    on, off = engine_on(tiny, cache), make_engine(tiny)
    compiled = on.runner.compiled_decode
    assert compiled.ready and compiled.stats.compiles_started == 0
    assert_same(run_scenario(on, one_at_a_time(PROMPTS)), expected)
    assert compiled.stats.compiled_steps == sum(GREEDY.max_tokens - 1 for _ in PROMPTS)
    # The pool holds what the eager step wrote (same pages: same allocator, same order).
    run_scenario(off, one_at_a_time(PROMPTS))
    for a, b in zip(on.runner.kv_pool.k_flat + on.runner.kv_pool.v_flat,
                    off.runner.kv_pool.k_flat + off.runner.kv_pool.v_flat):
        assert (a - b).abs().max() <= 1e-5


def tampered_copy(cache: Path, tmp_path: Path, how: str) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    package = next((copy / "compiled").glob("*.so"))
    sidecar = package.with_suffix(".json")
    if how == "bytes":                      # a flipped byte: the sha256 no longer matches
        data = bytearray(package.read_bytes())
        data[len(data) // 2] ^= 0xFF
        package.write_bytes(bytes(data))
    elif how == "key":                      # built for another torch
        side = json.loads(sidecar.read_text())
        side["key"]["torch_version"] = "0.0.0"
        sidecar.write_text(json.dumps(side))
    else:                                   # garbage whose sidecar vouches for it
        from radixserve.file_hash import file_sha256
        package.write_bytes(b"not a package")
        side = json.loads(sidecar.read_text())
        side["sha256"] = file_sha256(package)
        sidecar.write_text(json.dumps(side))
    return copy


@pytest.mark.parametrize("how", ["bytes", "key", "garbage"])
def test_a_tampered_artefact_is_refused_and_serving_stays_eager(tiny, expected, cache,
                                                                 tmp_path, monkeypatch,
                                                                 caplog, how):
    copy = tampered_copy(cache, tmp_path, how)
    # No compiler here: the refused artefact is not rebuilt, and the reason is logged.
    monkeypatch.setattr(compiled_decode, "find_cxx", lambda: None)
    with caplog.at_level(logging.WARNING, logger=compiled_decode.__name__):
        engine = engine_on(tiny, copy)
    compiled = engine.runner.compiled_decode
    assert not compiled.ready and compiled.stats.loads == 0
    assert "refused" in caplog.text and "no C++ compiler" in compiled.stats.reason
    assert not list((copy / "compiled").glob("*.so"))        # discarded, never loaded
    assert_same(run_scenario(engine, one_at_a_time(PROMPTS[:1])), expected[:1])
    assert compiled.stats.compiled_steps == 0


def test_without_a_compiler_the_server_serves_eagerly_with_the_reason(tiny, expected,
                                                                      tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setattr(compiled_decode, "find_cxx", lambda: None)
    with caplog.at_level(logging.WARNING, logger=compiled_decode.__name__):
        engine = engine_on(tiny, tmp_path)
    stats = engine.runner.compiled_decode.stats
    assert stats.state == "eager" and stats.compiles_started == 0
    assert "no C++ compiler" in caplog.text
    assert_same(run_scenario(engine, one_at_a_time(PROMPTS[:1])), expected[:1])


def test_on_refuses_what_the_compiled_step_cannot_serve(tiny, tmp_path):
    with pytest.raises(DecodeCompileError, match="deterministic"):
        engine_on(tiny, tmp_path, deterministic=True)
    engine = make_engine(tiny, decode_compile="auto", deterministic=True,
                         weights_cache_dir=str(tmp_path))
    assert engine.runner.compiled_decode is None        # auto: eager, logged
    assert CompiledDecode.create("off", tiny, engine.runner.kv_pool, tmp_path,
                                 deterministic=False, weights_cache_dir=None) is None
