"""The engine does its torch work on one thread: see radixserve/engine/compute_thread.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_helpers import QUESTIONS, chat_ids, collect, make_engine
from radixserve.engine.compute_thread import compute_executor, on_compute_thread
from radixserve.engine.host_memory import keep_freed_host_memory
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampling_params import SamplingParams


def test_on_compute_thread_runs_there_and_inline_when_already_there():
    main = threading.get_ident()
    there = on_compute_thread(threading.get_ident)
    assert there != main
    # Nested calls from the compute thread run inline (a submit would deadlock).
    assert on_compute_thread(on_compute_thread, threading.get_ident) == there
    assert compute_executor().submit(threading.get_ident).result() == there


def test_runner_is_built_and_steps_run_on_the_compute_thread(model_fp32, monkeypatch):
    built_on = []
    original_init = ModelRunner.__init__

    def recording_init(self, *args, **kwargs):
        built_on.append(threading.get_ident())
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "__init__", recording_init)
    engine = make_engine(model_fp32)
    stepped_on = set()
    execute = engine.runner.execute

    def recording_execute(batch):
        stepped_on.add(threading.get_ident())
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", recording_execute)

    async def scenario():
        await engine.start()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        got = await collect(engine.generate(chat_ids(engine, QUESTIONS[0]), params))
        await engine.shutdown()
        return got

    got = asyncio.run(scenario())
    assert len(got.token_ids[0]) == 4
    compute = on_compute_thread(threading.get_ident)
    assert built_on == [compute] and stepped_on == {compute}
    assert compute != threading.get_ident()
    # A second engine in the same process shares the thread (shutdown did not stop it).
    assert make_engine(model_fp32)._executor is compute_executor()


def test_warm_up_runs_a_prefill_and_returns_every_page(model_fp32, monkeypatch):
    engine = make_engine(model_fp32, warmup_tokens=300)
    warmed = []
    warm_up = engine.runner.warm_up

    def recording_warm_up(pages, num_tokens):
        warmed.append((len(pages), num_tokens, engine.memory.num_free))
        warm_up(pages, num_tokens)

    monkeypatch.setattr(engine.runner, "warm_up", recording_warm_up)
    total = engine.memory.num_pages

    async def scenario():
        await engine.start()
        after_start = engine.memory.num_free, engine.tree.total_tokens
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        got = await collect(engine.generate(chat_ids(engine, QUESTIONS[1]), params))
        await engine.shutdown()
        return after_start, got

    after_start, got = asyncio.run(scenario())
    assert warmed == [(300, 300, total - 300)]        # page size 1: the pages were lent
    assert after_start == (total, 0)                  # all back; nothing of it cached
    assert len(got.token_ids[0]) == 3 and got.final.usage.cached_tokens == 0
    engine.check_invariants()


def test_a_failing_warm_up_returns_its_pages(model_fp32, monkeypatch):
    engine = make_engine(model_fp32, warmup_tokens=64)

    def broken(pages, num_tokens):
        raise RuntimeError("injected warm-up failure")

    monkeypatch.setattr(engine.runner, "warm_up", broken)
    with pytest.raises(RuntimeError, match="injected warm-up failure"):
        asyncio.run(engine.start())
    assert engine.memory.num_free == engine.memory.num_pages
    engine.check_invariants()


def test_keep_freed_host_memory_applies_on_glibc_and_is_idempotent():
    import platform

    applied = keep_freed_host_memory()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert applied is True
    assert keep_freed_host_memory() is applied


def test_copy_on_write_runs_in_the_step_on_the_compute_thread(model_fp32, monkeypatch):
    """A match ending inside a page copies it as part of the next step, on the compute
    thread, before that step's forward writes the rest of the page."""
    engine = make_engine(model_fp32, page_size=16)
    events = []
    pool = engine.runner.kv_pool
    copy_prefix, forward = pool.copy_prefix, engine.runner.model.forward

    def recording_copy(src, dst, n):
        events.append(("copy", threading.get_ident(), n))
        copy_prefix(src, dst, n)

    def recording_forward(*args, **kwargs):
        events.append(("forward", threading.get_ident(), 0))
        return forward(*args, **kwargs)

    monkeypatch.setattr(pool, "copy_prefix", recording_copy)
    monkeypatch.setattr(engine.runner.model, "forward", recording_forward)
    prompt = chat_ids(engine, QUESTIONS[2])
    prompt = prompt[:len(prompt) - len(prompt) % 16]           # whole pages: all cached
    shorter = prompt[:len(prompt) - 16 + 6]                    # 5 + 1 tokens into the last
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def scenario():
        await engine.start()
        first = await collect(engine.generate(prompt, params))
        events.clear()
        # The match (len - 1 tokens) ends 5 tokens into the cached last page, which the
        # tree does not share: copy-on-write.
        again = await collect(engine.generate(shorter, params))
        n = len(events)
        cold = await collect(engine.generate(shorter, params, namespace="elsewhere"))
        del events[n:]
        await engine.shutdown()
        return first, again, cold

    first, again, cold = asyncio.run(scenario())
    assert cold.final.usage.cached_tokens == 0
    assert again.token_ids == cold.token_ids           # the copied KV is the right KV
    compute = on_compute_thread(threading.get_ident)
    assert again.final.usage.cached_tokens == len(shorter) - 1
    copies = [e for e in events if e[0] == "copy"]
    assert copies == [("copy", compute, 5)]
    assert events[0][0] == "copy" and events[1][0] == "forward"     # before the forward
    assert {e[1] for e in events} == {compute}
    engine.check_invariants()
