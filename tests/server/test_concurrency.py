"""64 concurrent streaming clients, a quarter hanging up early; cache namespaces."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server import http
from tests.server.conftest import MODEL, make_engine
from tests.server.live import LiveServer

CLIENTS = 64
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(loaded_model):
    with LiveServer(make_engine(loaded_model, max_running_requests=64)) as srv:
        yield srv


def one_client(url: str, i: int) -> tuple[str, list[dict]]:
    leaver = i % 4 == 0
    body = {"model": MODEL, "stream": True, "temperature": 0, "ignore_eos": True,
            "max_tokens": 400 if leaver else MAX_TOKENS, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": f"Say a number near {i}."}]}
    with http.SSEStream(url + "/v1/chat/completions", body, timeout=300) as s:
        assert s.status == 200
        events = s.events()
        if leaver:
            first_two = [next(events), next(events)]
            return "left", [json.loads(e) for e in first_two]
        got = list(events)
    assert got[-1] == "[DONE]"
    return "done", [json.loads(e) for e in got[:-1]]


def test_64_streams_with_a_quarter_leaving_early(server):
    before = dict(server.call(lambda: dict(server.engine.stats().requests_finished)))
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: one_client(server.url, i), range(CLIENTS)))
    done = [chunks for kind, chunks in results if kind == "done"]
    assert len(done) == CLIENTS - CLIENTS // 4
    for chunks in done:
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    server.check_invariants()           # waits until idle: the leavers' aborts have landed
    after = server.call(lambda: dict(server.engine.stats().requests_finished))
    assert after.get("abort", 0) - before.get("abort", 0) == CLIENTS // 4
    assert after.get("length", 0) - before.get("length", 0) == CLIENTS - CLIENTS // 4


def test_salted_prompts_never_share_the_cache(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Salted system prompt. " * 30},
                {"role": "user", "content": "Hello there"}]

    def cached(salt):
        extra = {"cache_salt": salt} if salt else None
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    first, prompt_len = cached("tenant-a")
    assert first == 0
    assert cached("tenant-a")[0] == prompt_len - 1
    assert cached("tenant-b")[0] == 0
    # the default namespace saw other chat prompts: at most the template's header matches
    assert cached(None)[0] < 10
    assert cached("tenant-c")[0] == 0
    assert cached("tenant-b")[0] == prompt_len - 1
    server.check_invariants()
