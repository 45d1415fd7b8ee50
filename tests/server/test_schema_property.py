"""Property: 100 random JSON schemas (nested objects, bounded arrays, enums, anyOf, string
patterns and formats), sent at once to a live server on SmolLM2 at temperature 1. Every
output validates with `jsonschema`; every schema with a keyword llguidance does not
implement gets a 400 naming it. Hypothesis draws the 100 schemas first; they are then sent
together, so the generations run batched (CI time)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL, make_engine
from tests.server.live import LiveServer

UNSUPPORTED = ["not", "uniqueItems", "if"]
NAMES = st.sampled_from(["id", "name", "tags", "size", "kind", "items", "note", "level"])


def leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.lists(st.sampled_from(["red", "green", "blue", 1, 2, True]), min_size=1, max_size=4,
                 unique=True).map(lambda e: {"enum": e}),
        st.sampled_from([{"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{1,3}$"},
                         {"type": "string", "format": "ipv4"},
                         {"type": "string", "format": "uuid"},
                         {"type": "string", "format": "email", "maxLength": 24}]),
    )


def schemas() -> st.SearchStrategy[dict]:
    def extend(inner):
        obj = st.dictionaries(NAMES, inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props,
                           "required": sorted(props), "additionalProperties": False})
        arr = st.builds(lambda items, lo, extra: {"type": "array", "items": items,
                                                  "minItems": lo, "maxItems": lo + extra},
                        inner, st.integers(0, 2), st.integers(0, 2))
        any_of = st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs})
        return st.one_of(obj, arr, any_of)
    return st.recursive(leaf(), extend, max_leaves=5)


def with_unsupported(schema: dict, keyword: str) -> dict:
    extra = {"not": {"type": "null"}, "uniqueItems": True,
             "if": {"type": "string"}}[keyword]
    return {"type": "object", "properties": {"x": {**schema, keyword: extra}},
            "required": ["x"]}


@pytest.fixture(scope="module")
def server(loaded_model, tmp_path_factory):
    engine = make_engine(loaded_model, max_running_requests=100,
                         grammar_cache_dir=str(tmp_path_factory.mktemp("grammars")))
    with LiveServer(engine) as srv:
        yield srv


async def _send_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(body):
            async with session.post(url, json=body) as r:
                return r.status, await r.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def draw_cases() -> list[tuple[dict, str | None]]:
    """100 hypothesis examples, gathered first and sent afterwards in one batch."""
    cases: list[tuple[dict, str | None]] = []

    @settings(max_examples=100, deadline=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), database=None)
    @given(schemas(), st.sampled_from([None] * 6 + UNSUPPORTED))
    def gather(schema, bad):
        schema = {"type": "object", "properties": {"v": schema}, "required": ["v"],
                  "additionalProperties": False}
        cases.append((with_unsupported(schema, bad) if bad else schema, bad))

    gather()
    return cases


def test_every_output_validates_and_every_refusal_names_the_keyword(server):
    cases = draw_cases()
    assert len(cases) == 100
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": "JSON please."}],
               "temperature": 1.0, "seed": i, "max_tokens": 200,
               "response_format": {"type": "json_schema", "json_schema": {
                   "name": f"s{i}", "strict": True, "schema": schema}}}
              for i, (schema, _) in enumerate(cases)]
    replies = asyncio.run(_send_all(server.base_url + "/chat/completions", bodies))
    refused = valid = 0
    for (schema, bad), (status, body) in zip(cases, replies):
        if bad is not None:
            assert status == 400, (schema, body)
            assert body["error"]["param"] == "response_format"
            assert f"'{bad}'" in body["error"]["message"], body
            refused += 1
            continue
        assert status == 200, (schema, body)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema,
                            format_checker=jsonschema.FormatChecker())
        valid += 1
    assert refused > 0 and valid > 50
    server.check_invariants()
    assert server.state.prompts.grammars.matchers.live == 0
