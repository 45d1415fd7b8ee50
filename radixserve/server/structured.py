"""What a request constrains its output to (response_format, a forced tool call, the native
route's json_schema / regex / ebnf / lark), compiled by the server's GrammarCompiler, with
every refusal a 400 naming the field (and the unsupported JSON-schema keyword)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance.gbnf_to_lark import gbnf_to_lark

from radixserve.engine.grammar import Grammar, GrammarError, GrammarSpec
from radixserve.engine.grammar_cache import GrammarCompiler, GrammarTimeout, compiler_for
from radixserve.server import protocol as P
from radixserve.server.errors import bad_request
from radixserve.server.tools import HERMES, JSON_STYLE, ToolChoice, ToolSet, call_grammar


@dataclass(frozen=True)
class ToolOutput:
    """A chat request whose output may hold tool calls (parsed by the renderer)."""

    toolset: ToolSet
    choice: ToolChoice

    @property
    def names(self) -> set[str]:
        return set(self.toolset.names()) if self.choice.mode != "named" else {self.choice.name}


def grammar_compiler(engine: Any) -> GrammarCompiler:
    """The server's compiler (engine/grammar_cache.py's `compiler_for` its config)."""
    return compiler_for(engine.tokenizer, engine.config)


def response_format_spec(rf: P.ResponseFormat | None) -> GrammarSpec | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_schema", json.dumps({"type": "object", "x-guidance": JSON_STYLE}))
    schema = rf.json_schema.schema
    return GrammarSpec.json_schema(_styled(schema))


def _styled(schema: Any) -> Any:
    """The schema with llguidance's compact-JSON options (", " and ": ", no free
    whitespace: a sampled model otherwise may pad with newlines until max_tokens)."""
    if schema is True:
        schema = {}
    if isinstance(schema, dict):
        return {**schema, "x-guidance": JSON_STYLE}
    return schema


def native_spec(s: P.NativeSampling) -> tuple[GrammarSpec | None, str]:
    """(spec, the field it came from) for /generate's sampling_params."""
    given = [n for n in ("json_schema", "regex", "ebnf", "lark") if getattr(s, n) is not None]
    if not given:
        return None, ""
    if len(given) > 1:
        raise bad_request(f"sampling_params.{given[1]}",
                          "give at most one of json_schema, regex, ebnf and lark")
    name = given[0]
    field = f"sampling_params.{name}"
    value = getattr(s, name)
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(field, f"'json_schema' is not valid JSON: {exc}") from None
        return GrammarSpec.json_schema(_styled(value)), field
    if name == "regex":
        return GrammarSpec("regex", value), field
    if name == "ebnf":
        try:
            return GrammarSpec("lark", gbnf_to_lark(value)), field
        except Exception as exc:
            raise bad_request(field, f"the EBNF (GBNF) grammar does not parse: "
                                     f"{str(exc)[:300]}") from None
    return GrammarSpec("lark", value), field


async def compile_for(compiler: GrammarCompiler, spec: GrammarSpec, field: str) -> Grammar:
    try:
        return await compiler.compile(spec)
    except GrammarTimeout as exc:
        raise bad_request(field, str(exc), "grammar_compile_timeout") from None
    except GrammarError as exc:
        where = f"{field} ({exc.keyword!r} is not supported)" if exc.keyword else field
        raise bad_request(field, f"{where}: the grammar was refused: {exc}",
                          "unsupported_schema" if exc.keyword else "invalid_grammar") from None


async def auto_call_grammar(compiler: GrammarCompiler, toolset: ToolSet, choice: ToolChoice,
                            parallel: bool, fmt: str = HERMES) -> Grammar | None:
    """`tool_choice: "auto"`: constrained to free text or well-formed calls when the library
    takes every tool's schema. When it refuses one (or the compile passes the cap) and no
    tool is `strict`, the output is left free and parsed, as before: OpenAI accepts any
    schema for a non-strict tool. With a strict tool the refusal is the 400 of a forced
    call."""
    spec = call_grammar(toolset, choice, parallel, fmt)
    if any(t.strict for t in toolset.tools):
        return await compile_for(compiler, spec, "tools")
    try:
        return await compiler.compile(spec)
    except GrammarError:
        return None
