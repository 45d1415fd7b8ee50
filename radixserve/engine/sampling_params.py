"""SamplingParams: how one request's tokens are chosen and when it stops.

Validated before anything is allocated so a bad request never touches the KV pool.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.engine.errors import InvalidRequest

if TYPE_CHECKING:
    from radixserve.engine.grammar import Grammar

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024           # a stop string longer than this is a mistake or an attack
ECHO_CHARS = 200                # error messages quote at most this much of a bad value


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxstring, r.maxlist, r.maxtuple, r.maxdict, r.maxother = 80, 6, 6, 6, 80
    return r


_REPR = _bounded_repr()


def shorten(value: object, limit: int = ECHO_CHARS) -> str:
    """A repr of `value` of at most `limit` characters: error messages echo bad values, and
    a hostile one (17 stop strings of 450 KB) must not make a megabyte error body.
    reprlib cuts long strings and lists before building anything large."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None         # same seed and prompt -> same output
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                      # parallel samples sharing the prompt's pages
    logprobs: int | None = None     # top-k logprobs returned per generated token
    include_stop_str_in_output: bool = False
    grammar: "Grammar | None" = None  # constrained decoding: each sample gets a matcher
    cache_key: str | None = None    # prompt_cache_key: a scheduling hint (lpm groups by it),
                                    #   never a cache namespace

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first bad field."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             "must be an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
             "must be -1 (disabled) or a non-negative integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= MAX_N,
             f"must be an integer between 1 and {MAX_N}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS
             and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
             f"{MAX_STOP_CHARS} characters"),
            ("stop_token_ids", all(isinstance(t, int) and 0 <= t < vocab_size
                                   for t in self.stop_token_ids),
             f"must be token ids in [0, {vocab_size})"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and self.seed >= 0),
             "must be a non-negative integer"),
            ("ignore_eos", not (self.ignore_eos and self.grammar is not None),
             "cannot be combined with a grammar (the grammar ends with end-of-sequence)"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise InvalidRequest(name, f"'{name}' {message} (got {shorten(getattr(self, name))})")
