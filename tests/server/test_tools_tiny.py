"""Tools on a tiny random model: a long tool block across two `radixserve serve` processes
(the second one's first request finds the block in the cache the first one saved, and
answers as the first did), and Llama 3's bare-JSON call format under `tool_choice` auto and
required, through a Llama-3-style chat template.

The tiny model keeps the starts and the 5,000-token prompts cheap; every wait is on an
event (a line the server prints, a reply, the process's exit).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from tests.server import http
from tests.server.conftest import make_engine
from tests.server.live import LiveServer
from tests.server.test_sigterm import read_until
from tests.server.test_tools import LLAMA3_TEMPLATE

PAGE_SIZE = 16
# Tools enough for a ~5,000-token block with the tiny byte-level tokenizer: past the
# 4,096 tokens (two 2,048-token prefill chunks) a shutdown's save used to stop at.
TOOLS = [{"type": "function", "function": {
    "name": f"lookup_{i:02d}", "description": f"Look up record kind {i} by query.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 12},
        "mode": {"enum": ["fast", "exact"]}},
        "required": ["query", "mode"], "additionalProperties": False}}} for i in range(22)]
ASK = [{"role": "user", "content": "Find record 7 for alpha."}]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """The same tiny Llama twice: with the test tokenizer's plain template (tools go into
    the default Hermes block) and with a Llama-3-style template that renders tools."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from tiny_models import hf_config, random_hf_model, save_hf_dir, tiny_tokenizer
    root = tmp_path_factory.mktemp("tiny-tools")
    plain = save_hf_dir(root / "plain", random_hf_model(
        hf_config("llama", max_position_embeddings=8192)))
    llama3 = root / "llama3"
    shutil.copytree(plain, llama3)
    tok = tiny_tokenizer()
    tok.chat_template = LLAMA3_TEMPLATE
    tok.save_pretrained(llama3)
    return {"plain": plain, "llama3": llama3}


class Server:
    """`radixserve serve` on a tiny model as a subprocess, its output kept in `lines`;
    `restored`: the tokens it restored from the directory at start."""

    def __init__(self, model: Path, kv: Path):
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0", "--model",
               str(model), "--dtype", "float32", "--device", "cpu", "--kv-cache-tokens",
               "16384", "--page-size", str(PAGE_SIZE), "--kv-disk-dir", str(kv),
               "--grammar-prewarm", "0", "--debug-invariants"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        m, self.lines = read_until(self.proc, r"serving .* on (http://127\.0\.0\.1:\d+)")
        self.url = m.group(1)
        m, more = read_until(self.proc, r"KV disk store .*: restored (\d+) tokens")
        self.lines += more
        self.restored = int(m.group(1))
        self._rest = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                      daemon=True)
        self._rest.start()

    def chat(self, tools: list[dict]) -> dict:
        body = {"messages": ASK, "tools": tools, "tool_choice": "required", "max_tokens": 128,
                "temperature": 0, "logprobs": True, "parallel_tool_calls": False}
        reply = http.post(self.url + "/v1/chat/completions", json=body, timeout=300)
        assert reply.status == 200, reply.text
        return reply.json()

    def stop(self) -> None:
        """SIGTERM (the cache is saved), exit 0."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=300) == 0, "".join(self.lines[-20:])
        self._rest.join(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _answer(reply: dict) -> tuple:
    """What greedy decoding produced: the tokens, and the calls without their random ids."""
    choice = reply["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in choice["message"].get("tool_calls") or []]
    return [t["token"] for t in choice["logprobs"]["content"]], calls, choice["finish_reason"]


def test_second_process_first_tool_request_hits_the_saved_tool_block(tiny_dirs, tmp_path):
    """The first server computes the block and saves it on SIGTERM; the second, on the same
    directory, restores every whole page of that prompt, and its first request, tools in
    another order, hits >= 95% of the block and returns the same greedy call."""
    kv = tmp_path / "kv"
    first = Server(tiny_dirs["plain"], kv)
    try:
        cold = first.chat(TOOLS)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        block = _block_tokens(first.url)
        assert block > 4600, block
        first.stop()
    finally:
        first.kill()

    shuffled = list(TOOLS)
    random.Random(1).shuffle(shuffled)
    second = Server(tiny_dirs["plain"], kv)
    try:
        whole_pages = cold["usage"]["prompt_tokens"] // PAGE_SIZE * PAGE_SIZE
        assert second.restored >= whole_pages, (second.restored, whole_pages)
        warm = second.chat(shuffled)
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.95 * block, (cached, block)
        assert warm["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
        assert _answer(warm) == _answer(cold) and _answer(cold)[1], _answer(cold)
        second.stop()
    finally:
        second.kill()


def _block_tokens(url: str) -> int:
    """Prompt tokens of the tool block alone: a request whose messages are just the ask,
    minus the same request without tools (the block is the system message before it)."""
    with_tools = _prompt_tokens(url, TOOLS)
    return with_tools - _prompt_tokens(url, None)


def _prompt_tokens(url: str, tools: list[dict] | None) -> int:
    body = {"messages": ASK, "max_tokens": 1, "temperature": 0,
            **({"tools": tools, "tool_choice": "none"} if tools else {})}
    reply = http.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def llama3_server(tiny_dirs, tmp_path_factory):
    """The tiny model with the Llama-3-style template, served in this process."""
    from radixserve.model import load_model
    path = str(tiny_dirs["llama3"])
    engine = make_engine(load_model(path, dtype="float32", device="cpu"), model=path,
                         grammar_cache_dir=str(tmp_path_factory.mktemp("grammars")))
    with LiveServer(engine) as srv:
        yield srv


def _chat(server: LiveServer, **body) -> dict:
    reply = http.post(server.url + "/v1/chat/completions",
                      json={"messages": ASK, "tools": TOOLS[:3], **body}, timeout=300)
    assert reply.status == 200, reply.text
    return reply.json()


def _valid_calls(message: dict) -> list[dict]:
    """The message's calls, each of a sent tool with arguments its schema accepts."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS[:3]}
    calls = message.get("tool_calls") or []
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])
    return calls


def test_llama3_family_calls_are_bare_json_and_auto_is_constrained(llama3_server):
    """With a template that renders tools and asks for `{"name", "parameters"}`, a forced
    call is generated as bare JSON (no tag) and parsed into `tool_calls`; the call and its
    result go back through the template; under `auto` every sample is either text that
    does not start with '{' or well-formed calls."""
    forced = _chat(llama3_server, tool_choice="required", max_tokens=128, temperature=0,
                   logprobs=True)
    choice = forced["choices"][0]
    generated = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert generated.startswith('{"name": "lookup_0') and '"parameters": {' in generated
    calls = _valid_calls(choice["message"])
    assert len(calls) == 1 and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None

    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "3 rows"}]
    after = _chat(llama3_server, messages=history, tool_choice="auto", max_tokens=16,
                  temperature=0)
    assert after["usage"]["prompt_tokens"] > forced["usage"]["prompt_tokens"]

    auto = _chat(llama3_server, tool_choice="auto", max_tokens=24, temperature=1.5, seed=3,
                 n=12)
    for c in auto["choices"]:
        if _valid_calls(c["message"]):
            assert c["finish_reason"] == "tool_calls"
        else:
            assert not (c["message"]["content"] or "").lstrip().startswith("{"), c
    llama3_server.check_invariants()
