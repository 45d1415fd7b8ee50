"""Compare llguidance and xgrammar on this project's tokenizer (SmolLM2 by default):
grammar compile time for a 50-tool schema, per-step mask time at batch 32, and which
JSON-schema features each accepts. The figures behind docs/structured.md's choice.

    PYTHONPATH=$PWD python scripts/compare_grammar_libs.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.model.tokenizer_loader import load_tokenizer

BATCH = 32
STEPS = 40


def tool_schema(i: int) -> dict:
    """One tool's call object: name const + typed arguments (as a 'required' tool_choice)."""
    return {"type": "object", "properties": {
        "name": {"const": f"tool_{i:02d}"},
        "arguments": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 64},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "mode": {"enum": ["fast", "exact", f"mode_{i}"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        }, "required": ["query", "limit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}


def fifty_tools() -> dict:
    return {"type": "array", "minItems": 1, "maxItems": 4,
            "items": {"anyOf": [tool_schema(i) for i in range(50)]}}


FEATURES = {
    "nested objects": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]},
    "array bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "enum": {"enum": ["x", "y", 3]},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"n": {"type": "integer"}}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/n"}}},
    "recursive $ref": {"$defs": {"t": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
    "string pattern": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]+$"},
    "string length": {"type": "string", "minLength": 2, "maxLength": 5},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "integer range": {"type": "integer", "minimum": -5, "maximum": 5},
    "number exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 3},
    "const": {"const": "fixed"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "not": {"not": {"type": "string"}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "minProperties": {"type": "object", "minProperties": 1},
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
        self.ll, self.lt = llguidance, lt
        self.tokenizer = llguidance.hf.from_tokenizer(tok.hf)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matchers(self, grammar, n):
        return [self.ll.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n, vocab):
        return self.lt.allocate_token_bitmask(n, vocab)

    def fill(self, matchers, bitmask):
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                            bitmask)

    def apply(self, logits, bitmask):
        self.lt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token):
        assert m.consume_token(token), m.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf))
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = None

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matchers(self, grammar, n):
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n, vocab):
        return self.xgr.allocate_token_bitmask(n, vocab)

    def fill(self, matchers, bitmask):
        if self.batch is None:
            self.batch = self.xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token):
        assert m.accept_token(token)

    def reload(self, grammar) -> tuple[int, float]:
        """A restart's alternative to compiling: (serialised bytes, CPU ms to load them)."""
        text = grammar.serialize_json()
        t = time.process_time()
        self.xgr.CompiledGrammar.deserialize_json(text, self.info)
        return len(text), (time.process_time() - t) * 1e3


def measure(lib, vocab: int) -> dict:
    out = {}
    schema = fifty_tools()
    t = time.perf_counter()
    grammar = lib.compile(schema)
    out["compile_50_tools_ms"] = (time.perf_counter() - t) * 1e3
    if hasattr(lib, "reload"):          # llguidance has no serialised compiled grammar
        t = time.process_time()
        lib.compile(schema)
        out["compile_50_tools_cpu_ms"] = (time.process_time() - t) * 1e3
        out["serialised_50_tools_bytes"], out["deserialise_50_tools_cpu_ms"] = lib.reload(grammar)
    # Mask time: 32 matchers walking a valid call, token by token.
    call = json.dumps([{"name": "tool_07", "arguments": {"query": "weather in paris today",
                                                         "limit": 5, "mode": "fast"}}])
    ids = tokenizer.hf.encode(call, add_special_tokens=False)
    matchers = lib.matchers(grammar, BATCH)
    bitmask = lib.bitmask(BATCH, vocab)
    logits = torch.randn(BATCH, vocab)
    fill, apply = [], []
    for step in range(min(STEPS, len(ids))):
        t = time.perf_counter()
        lib.fill(matchers, bitmask)
        fill.append(time.perf_counter() - t)
        t = time.perf_counter()
        lib.apply(logits, bitmask)
        apply.append(time.perf_counter() - t)
        for m in matchers:
            lib.accept(m, ids[step])
    out["mask_fill_b32_ms_median"] = statistics.median(fill) * 1e3
    out["mask_apply_b32_ms_median"] = statistics.median(apply) * 1e3
    supported = []
    for feature, s in FEATURES.items():
        try:
            lib.compile(s)
            supported.append(feature)
        except Exception:
            pass
    out["features"] = f"{len(supported)}/{len(FEATURES)}"
    out["unsupported"] = sorted(set(FEATURES) - set(supported))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    vocab = len(tokenizer.hf)
    torch.set_num_threads(1)
    for cls in (Llguidance, Xgrammar):
        t = time.perf_counter()
        try:
            lib = cls(tokenizer)
        except ImportError as exc:      # xgrammar is not a dependency: pip install xgrammar
            print(json.dumps({"library": cls.name, "skipped": str(exc)}))
            continue
        setup = (time.perf_counter() - t) * 1e3
        r = measure(lib, vocab)
        print(json.dumps({"library": cls.name, "tokenizer_setup_ms": round(setup, 1),
                          **{k: (round(v, 3) if isinstance(v, float) else v)
                             for k, v in r.items()}}))
