"""`radixserve batch`: OpenAI batch lines in, results in input order; shared preambles are
computed once; bad lines become error lines."""

from __future__ import annotations

import asyncio
import io
import json

import msgspec

from radixserve.engine.sampling_params import SamplingParams
from radixserve.server.batch_job import parse_line, run_batch, work_order
from radixserve.server.prompts import ModelInfo, PromptBuilder
from tests.server.conftest import make_engine
from tests.server.fake_engine import ByteTokenizer

PREAMBLE = ("Answer each question with one word. Examples follow. " +
            " ".join(f"Q: What colour is item number {i}? A: Blue." for i in range(30)))
QUESTIONS = ["What colour is the sky?", "What colour is grass?", "What colour is snow?",
             "What colour is coal?", "What colour is blood?", "What colour is the sun?"]


def chat_line(cid: str, question: str) -> bytes:
    return msgspec.json.encode({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "anything", "max_tokens": 4, "temperature": 0,
                                         "messages": [{"role": "system", "content": PREAMBLE},
                                                      {"role": "user", "content": question}]}})


def test_work_order_puts_shared_prefixes_together():
    tok = ByteTokenizer()
    info = ModelInfo("m", 4096, tok.vocab_size)
    lines = []
    for i in range(6):
        group = "AAAA" if i % 2 == 0 else "BBBB"
        lines.append(msgspec.json.encode({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                          "body": {"prompt": group * 10 + str(i), "max_tokens": 1}}))
    prompts = PromptBuilder(tok, info)

    async def parse_all():
        return [await parse_line(i, line, prompts, set()) for i, line in enumerate(lines)]
    items = asyncio.run(parse_all())
    prompts.close()
    order = [it.custom_id for it in work_order(items)]
    assert order == ["c0", "c2", "c4", "c1", "c3", "c5"]


def test_batch_file_with_few_shot_preamble(loaded_model):
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    lines.insert(2, b'{"custom_id": "broken", "method": "POST", "url": ')        # malformed JSON
    lines.insert(4, msgspec.json.encode({"custom_id": "bad-body", "method": "POST",
                                         "url": "/v1/chat/completions",
                                         "body": {"messages": [], "max_tokens": 4}}))
    lines.insert(5, msgspec.json.encode({"custom_id": "bad-url", "method": "POST",
                                         "url": "/v1/embeddings", "body": {}}))
    lines.append(msgspec.json.encode({"custom_id": "comp", "method": "POST", "url": "/v1/completions",
                                      "body": {"prompt": "The sky is", "max_tokens": 3,
                                               "temperature": 0}}))
    engine = make_engine(loaded_model, max_running_requests=4)
    out = io.BytesIO()

    async def go():
        await engine.start()
        try:
            summary = await run_batch(engine, lines, out, concurrency=8, progress=False)
            refs = {}
            for i, q in enumerate(QUESTIONS):      # reference: the engine, request by request
                ids = engine.tokenizer.apply_chat_template(
                    [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": q}])
                text = ""
                async for o in engine.generate(ids, SamplingParams(max_tokens=4, temperature=0)):
                    text += o.text
                refs[f"q{i}"] = (text, len(ids))
            engine.check_invariants()
            return summary, refs
        finally:
            await engine.shutdown()

    summary, refs = asyncio.run(go())
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in results] == \
        ["q0", "q1", None, "q2", "bad-body", "bad-url", "q3", "q4", "q5", "comp"]
    by_id = {r["custom_id"]: r for r in results}
    assert results[2]["response"] is None and results[2]["error"]["code"] == "invalid_line"
    assert by_id["bad-url"]["response"] is None and by_id["bad-url"]["error"]["code"] == "invalid_url"
    bad = by_id["bad-body"]
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "messages"
    assert by_id["comp"]["response"]["status_code"] == 200
    assert by_id["comp"]["response"]["body"]["object"] == "text_completion"
    cached = []
    for cid, (ref_text, prompt_len) in refs.items():
        r = by_id[cid]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        body = r["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == ref_text
        assert body["usage"]["prompt_tokens"] == prompt_len
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    preamble_len = len(loaded_model.tokenizer.apply_chat_template(
        [{"role": "system", "content": PREAMBLE}], add_generation_prompt=False))
    assert preamble_len > 300
    # the preamble is computed once: every question but the first finds it cached
    assert sorted(cached)[1] >= preamble_len - 2, cached
    assert summary.requests == 10 and summary.errors == 3
