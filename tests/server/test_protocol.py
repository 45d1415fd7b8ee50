"""Request decoding and the mapping to SamplingParams (no server, no model)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from radixserve.server import protocol as P
from radixserve.server.auth import AuthConfig, cache_namespace
from radixserve.server.errors import ApiError
from radixserve.server.prompts import (ModelInfo, PromptBuilder, fit_context, prepare_chat,
                                       prepare_completion)
from tests.server.fake_engine import ByteTokenizer

INFO = ModelInfo(name="m", max_model_len=100, vocab_size=260)
TOK = ByteTokenizer()
PROMPTS = PromptBuilder(TOK, INFO)


def chat(body: dict, key_ns=None):
    req = P.decode(msgspec.json.encode(body), P.ChatCompletionRequest)
    return asyncio.run(prepare_chat(req, PROMPTS, key_ns))


def err(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_chat_fields_map_to_sampling_params():
    p = chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
              "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": "x", "n": 2,
              "logprobs": True, "top_logprobs": 4, "stop_token_ids": [9], "ignore_eos": True,
              "some_unknown_field": {"nested": 1}})
    sp = p.params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (7, 0.5, 0.9, 5, 3)
    assert (sp.stop, sp.n, sp.logprobs, sp.stop_token_ids, sp.ignore_eos) == (["x"], 2, 4, [9], True)
    assert p.prompt_ids == TOK.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_defaults_fill_the_context_and_openai_defaults():
    p = chat({"messages": [{"role": "user", "content": "hi"}]})
    assert p.params.max_tokens == INFO.max_model_len - len(p.prompt_ids)
    assert (p.params.temperature, p.params.top_p, p.params.n, p.params.logprobs) == (1.0, 1.0, 1, None)
    assert chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).params.logprobs == 0
    assert chat({"messages": [{"role": "user", "content": "x"}],
                 "max_completion_tokens": 3, "max_tokens": 9}).params.max_tokens == 3


def test_text_content_parts_are_joined_and_developer_is_system():
    p = chat({"messages": [{"role": "developer", "content": "S"},
                           {"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}]})
    assert p.prompt_ids == TOK.apply_chat_template([{"role": "system", "content": "S"},
                                                    {"role": "user", "content": "ab"}])
    e = err(chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert (e.status, e.param) == (400, "messages[0].content[0].type")


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "model"),
])
def test_chat_validation_names_the_field(body, status, param):
    e = err(chat, body)
    assert (e.status, e.param) == (status, param), e.message
    assert param.split("[")[0].split(".")[-1] in e.message or status == 404


def test_malformed_json_is_400_without_param():
    e = err(P.decode, b'{"messages": [', P.ChatCompletionRequest)
    assert (e.status, e.param, e.code) == (400, None, "invalid_json")


def test_completion_prompt_forms():
    def comp(body):
        req = P.decode(msgspec.json.encode(body), P.CompletionRequest)
        return asyncio.run(prepare_completion(req, PROMPTS))
    assert comp({"prompt": "ab"}).prompt_ids == [97, 98]
    assert comp({"prompt": [97, 98]}).prompt_ids == [97, 98]
    assert comp({"prompt": ["ab"]}).prompt_ids == [97, 98]
    assert comp({"prompt": [[97, 98]]}).prompt_ids == [97, 98]
    assert comp({"prompt": "ab"}).params.max_tokens == 16          # OpenAI's default
    assert comp({"prompt": "ab", "logprobs": 2}).params.logprobs == 2
    assert comp({"prompt": "ab", "echo": True}).echo_text == "ab"
    assert (err(comp, {"prompt": ["a", "b"]}).status, err(comp, {"prompt": ["a", "b"]}).param) == (400, "prompt")
    assert err(comp, {"prompt": [1, 999]}).param == "prompt[1]"
    assert err(comp, {"prompt": ""}).param == "prompt"
    assert err(comp, {}).param == "prompt"


def test_context_rule_rejects_never_clamps():
    assert fit_context(10, None, INFO, "p") == 90
    assert fit_context(10, 90, INFO, "p") == 90
    assert err(fit_context, 10, 91, INFO, "p").param == "max_tokens"
    assert err(fit_context, 100, None, INFO, "p").param == "p"


def test_namespaces_hash_keys_and_salts():
    auth = AuthConfig(("k1", "k2"), namespace_per_api_key=True)
    assert auth.check("Bearer k2") == "k2" and auth.check("Bearer k3") is None
    assert auth.check(None) is None and auth.check("k1") is None
    n1, n2 = auth.key_namespace("k1"), auth.key_namespace("k2")
    assert n1 != n2 and "k1" not in n1
    assert AuthConfig(("k1",)).key_namespace("k1") is None
    assert cache_namespace(None, None) is None
    a, b = cache_namespace(None, "s1"), cache_namespace(None, "s2")
    assert a != b and "s1" not in a
    assert cache_namespace(n1, "s1") not in (n1, a, cache_namespace(n2, "s1"))
    assert chat({"messages": [{"role": "user", "content": "x"}], "cache_salt": "s1"}, n1).namespace \
        == cache_namespace(n1, "s1")


def test_decoded_messages_are_not_tracked_by_the_garbage_collector():
    """200,000 tracked messages meant ~270 collections per body, each holding the GIL
    (issue 39): messages are leaves of a JSON tree, so they cannot form cycles."""
    import gc
    body = {"messages": [{"role": "user", "content": "x"},
                         {"role": "user", "content": [{"type": "text", "text": "y"}]}]}
    req = P.decode(msgspec.json.encode(body), P.ChatCompletionRequest)
    assert [gc.is_tracked(m) for m in req.messages] == [False, False]
    assert not gc.is_tracked(req.messages[1].content[0])
    assert req.messages[1].text("messages[1]") == "y"
