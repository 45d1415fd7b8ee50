"""The official `openai` client against a live server on the real engine and model."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.engine.sampling_params import SamplingParams
from tests.server import http
from tests.server.conftest import MODEL, make_engine
from tests.server.live import LiveServer

SYSTEM = ("You are a meticulous assistant for a small bakery. " +
          " ".join(f"Rule {i}: answer politely, mention bread type {i}, and never invent prices."
                   for i in range(1, 25)))
QUESTION = "What time do you open on Sundays?"


@pytest.fixture(scope="module")
def server(loaded_model):
    with LiveServer(make_engine(loaded_model)) as srv:
        yield srv


@pytest.fixture()
def client(server):
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    server.check_invariants()


def engine_text(server, prompt_ids, **params) -> tuple[str, list[int]]:
    """Reference: the same request straight through the engine, no HTTP."""
    async def go():
        text, ids = [], []
        async for out in server.engine.generate(prompt_ids, SamplingParams(**params)):
            text.append(out.text)
            ids += out.token_ids
        return "".join(text), ids
    return server.run(go())


def chat_ids(server, messages):
    return server.call(server.engine.tokenizer.apply_chat_template, messages)


def test_chat_stream_and_not_match_the_engine(server, client):
    messages = [{"role": "user", "content": "Name three colours."}]
    assert http.post(server.url + "/cache/flush").status == 200      # nothing cached before
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ref, ref_ids = engine_text(server, chat_ids(server, messages), max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ref_ids)
    assert r.usage.prompt_tokens == len(chat_ids(server, messages))
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == len(ref_ids)
    # the same prompt again: all of it but the last token (which must be computed) is cached
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_completions_stream_and_not(server, client):
    prompt = "The capital of France is"
    ref, ref_ids = engine_text(server, server.engine.tokenizer.encode(prompt), max_tokens=8,
                               temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == ref and r.usage.completion_tokens == len(ref_ids)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == ref
    r = client.completions.create(model=MODEL, prompt=server.engine.tokenizer.encode(prompt),
                                  max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == prompt + ref


def test_shared_system_prompt_hits_the_cache_with_equal_output(server, client):
    def ask(question):
        return client.chat.completions.create(
            model=MODEL, max_tokens=16, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    system_len = len(chat_ids(server, [{"role": "system", "content": SYSTEM}]))
    assert system_len > 300
    first = ask(QUESTION)
    assert first.usage.prompt_tokens_details.cached_tokens < system_len
    again = ask(QUESTION)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= system_len
    other = ask("Do you sell rye bread?")
    assert other.usage.prompt_tokens_details.cached_tokens >= system_len - 5


def engine_samples(server, prompt_ids, **params) -> list[tuple[str, int]]:
    """Reference for n > 1: (text, token count) per sample index, straight from the engine."""
    async def go():
        n = params.get("n", 1)
        text, count = [""] * n, [0] * n
        async for out in server.engine.generate(prompt_ids, SamplingParams(**params)):
            text[out.index] += out.text
            count[out.index] += len(out.token_ids)
        return list(zip(text, count))
    return server.run(go())


def test_n2_sampling_and_greedy(server, client):
    messages = [{"role": "user", "content": "Write a word."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2,
                                       temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content      # greedy: equal
    ref = engine_samples(server, chat_ids(server, messages), max_tokens=6, n=2, temperature=1.0,
                         seed=7)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2,
                                       temperature=1.0, seed=7)
    assert [c.message.content for c in r.choices] == [text for text, _ in ref]
    assert r.usage.completion_tokens == sum(count for _, count in ref)
    assert r.usage.prompt_tokens == len(chat_ids(server, messages))
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                   n=2, temperature=1.0, seed=7, stream=True))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices and c.choices[0].index == i)
        assert text == ref[i][0]


def test_stop_sequences_cut_the_text(server, client):
    prompt = "Count from one to twenty in words: one, two, three,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert " six" in text, text                          # the model counts on; pick a stop in it
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                    stop=[" six", "never-appears"])
    assert cut.choices[0].text == text[:text.index(" six")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=" six", stream=True))
    assert streamed == cut.choices[0].text


def test_logprobs_shapes_and_greedy_consistency(server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.logprob == pytest.approx(max(t.logprob for t in tok.top_logprobs), abs=1e-4)
        assert tok.token == tok.top_logprobs[0].token
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == c.usage.completion_tokens
    assert "".join(lp.tokens) == c.choices[0].text


def test_native_generate_and_metrics(server, client):
    ids = server.engine.tokenizer.encode("Once upon a time")
    r = http.post(server.url + "/generate",
                  json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    body = r.json()
    ref, ref_ids = engine_text(server, ids, max_tokens=6, temperature=0)
    assert r.status == 200 and body["output_ids"] == ref_ids and body["text"] == ref
    assert body["meta_info"]["prompt_tokens"] == len(ids)
    again = http.post(server.url + "/generate",
                      json={"text": "Once upon a time", "sampling_params": {"max_new_tokens": 6,
                                                                           "temperature": 0}}).json()
    assert again["output_ids"] == ref_ids and again["meta_info"]["cached_tokens"] == len(ids) - 1
    stats = http.get(server.url + "/cache/stats").json()
    pool = stats["pool"]
    assert stats["cache"]["cached_tokens"] > 0 and pool["pages_total"] > 0
    assert pool["pages_free"] + pool["pages_cached"] + pool["pages_private"] == pool["pages_total"]
    assert pool["pages_private"] == 0                    # idle: every page is free or cached
    assert stats["pool"]["bytes_total"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    metrics = {s.name: s.value for fam in text_string_to_metric_families(http.get(server.url + "/metrics").text)
               for s in fam.samples if not s.labels}
    assert metrics["radixserve_prefix_cache_hits_tokens_total"] == stats["prefix_cache"]["hit_tokens"]
    assert metrics["radixserve_prefix_cache_queries_tokens_total"] >= metrics["radixserve_prefix_cache_hits_tokens_total"]
    assert metrics["radixserve_generation_tokens_total"] > 0
    assert metrics["radixserve_time_to_first_token_seconds_count"] > 0
    assert metrics["radixserve_e2e_request_latency_seconds_count"] > 0
