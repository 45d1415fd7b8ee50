"""Turn a trace into the key sequences the radix tree sees, in token or block mode.

Token mode feeds the tree real token ids with the chosen page size: exactly what the
server's cache would see. Block mode feeds one *symbol per page*: a symbol names a page's
content together with its whole prefix (for hash-id traces: block id and page index within
the block; for text traces: a chained id of the page's tokens), so the tree holds
``page_size / 2`` times fewer keys, and the hit counts equal token mode's (docs/replay.md
names the two approximations: cached outputs, and partial pages of text traces).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from . import tokens as tk
from .traces import HashRequest, TextRequest, Trace

Mode = Literal["token", "block"]


@dataclass(frozen=True, slots=True)
class ReplayItem:
    """One request as the replayer drives it through the cache."""

    prompt_len: int            # tokens in the prompt (L)
    output_len: int            # output tokens that occupy pages (0 without --include-outputs)
    prompt_keys: Sequence[int]  # token ids (token mode) or page keys (block mode)
    full_keys: Sequence[int] | None  # prompt + output keys for the final insert, if any


PAGE_MARK = -1  # second key of every page in block mode (see KeySpace)


@dataclass(frozen=True, slots=True)
class KeySpace:
    """How keys relate to tokens and pages in one mode.

    Block mode writes each page as two keys, ``[symbol, PAGE_MARK]``, in a tree of page
    size 2. A match capped inside a page then compares only the symbol, and the tree reports
    it as a copy-on-write hit on that page, exactly as token mode does when a prompt's last
    (partial) page is a prefix of a cached page: same hits, same splits, same lock handles.
    """

    mode: Mode
    page_size: int        # tokens per KV page (the capacity unit)
    tree_page_size: int   # keys per page: page_size (token mode) or 2 (block mode)

    def max_match_keys(self, prompt_len: int) -> int:
        """Keys the match may cover: those of the first L-1 tokens (one is always computed)."""
        n = prompt_len - 1
        if self.mode == "token":
            return n
        full, part = divmod(n, self.page_size)
        return 2 * full + (1 if part else 0)

    def hit_tokens(self, matched_keys: int, num_pages: int, cow: bool, prompt_len: int) -> int:
        """Prompt tokens a match serves from the cache."""
        if self.mode == "token":
            return matched_keys
        # A block-mode copy-on-write match covers all the matchable tokens of its page.
        return prompt_len - 1 if cow else num_pages * self.page_size

    def keys_for_pages(self, num_pages: int) -> int:
        return num_pages * self.tree_page_size


def interleave_mark(symbols: np.ndarray) -> np.ndarray:
    """[s0, s1, ...] -> [s0, MARK, s1, MARK, ...]: the block-mode key of each page."""
    out = np.full(2 * len(symbols), PAGE_MARK, dtype=np.int64)
    out[0::2] = symbols
    return out


class Workload:
    """The replay items of a trace in one mode; built once and reused across a sweep.

    Block mode precomputes every item (small: one int per page); token mode synthesizes
    each item when it is asked for, so a whole trace never sits in memory as tokens.
    """

    def __init__(self, trace: Trace, mode: Mode, page_size: int,
                 include_outputs: bool = False, tokenizer: tk.TextTokenizer | None = None):
        if page_size < 1:
            raise ValueError(f"page size must be >= 1, got {page_size}")
        bs = trace.block_size
        if mode == "block" and trace.format == "hash" and bs % page_size:
            raise ValueError(f"block mode needs the page size ({page_size}) to divide the "
                             f"block size ({bs}); use --mode token")
        if trace.format == "text" and tokenizer is None:
            tokenizer = tk.TextTokenizer("smollm2-135m-instruct")
        self.trace = trace
        self.include_outputs = include_outputs
        self.tokenizer = tokenizer
        self.space = KeySpace(mode, page_size, 2 if mode == "block" else page_size)
        self._items: list[ReplayItem] | None = None
        self._tokenized: list[tuple[list[int], Sequence[int] | None, int]] | None = None
        if trace.format == "hash":
            self.max_block_id = max(max(r.hash_ids) for r in trace.requests)
            if mode == "token":
                top = (self.max_block_id + 1) * bs + sum(m for _, m in self.lengths())
                if top >= 1 << 62:
                    raise ValueError(f"{self.max_block_id + 1} blocks of {bs} tokens are too "
                                     "many synthesized token ids for token mode; use "
                                     "--mode block")

    def __len__(self) -> int:
        return len(self.trace.requests)

    def __iter__(self) -> Iterator[ReplayItem]:
        if self._items is not None:
            return iter(self._items)
        if self.space.mode == "block":
            self._items = list(self._generate())
            return iter(self._items)
        return self._generate()

    def items(self) -> list[ReplayItem]:
        """Every item, materialized (block mode keeps them; token mode builds them anew)."""
        return self._items if self._items is not None else list(self)

    def lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, output tokens that take pages) per request, without keys."""
        if self.trace.format == "hash":
            return [(r.input_length, self._out_len(r)) for r in self.trace.requests]
        return [(len(p), m) for p, _, m in self._text_token_lists()]

    def page_demand(self) -> int:
        """Pages that hold every request at once: an unbounded cache for this trace."""
        ps = self.space.page_size
        return sum(math.ceil((L + m) / ps) for L, m in self.lengths()) + 1

    # -- generation ------------------------------------------------------------------

    def _generate(self) -> Iterator[ReplayItem]:
        if self.trace.format == "hash":
            gen = (self._hash_blocks() if self.space.mode == "block"
                   else self._hash_tokens())
        else:
            gen = self._text_blocks() if self.space.mode == "block" else self._text_tokens()
        yield from gen

    def _out_len(self, req) -> int:
        return req.output_length if self.include_outputs else 0

    def _hash_tokens(self) -> Iterator[ReplayItem]:
        bs = self.trace.block_size
        base = tk.hash_output_base(self.max_block_id, bs)
        for req in self.trace.requests:
            prompt = tk.hash_prompt_tokens(req, bs)
            m = self._out_len(req)
            full = None
            if m:
                full = np.concatenate([prompt, tk.output_tokens(base, m)])
                base += m
            yield ReplayItem(req.input_length, m, prompt, full)

    def _hash_blocks(self) -> Iterator[ReplayItem]:
        bs, ps = self.trace.block_size, self.space.page_size
        per_block = bs // ps
        sub = np.arange(per_block, dtype=np.int64)[None, :]
        base = (self.max_block_id + 1) * per_block  # fresh symbols for output pages
        for req in self.trace.requests:
            req: HashRequest
            L, m = req.input_length, self._out_len(req)
            ids = np.asarray(req.hash_ids, dtype=np.int64)[:, None]
            prompt = (ids * per_block + sub).reshape(-1)[: math.ceil(L / ps)]
            full = None
            if m:
                fresh = math.ceil((L + m) / ps) - L // ps
                full = interleave_mark(np.concatenate(
                    [prompt[: L // ps], np.arange(base, base + fresh, dtype=np.int64)]))
                base += fresh
            yield ReplayItem(L, m, interleave_mark(prompt), full)

    def _text_token_lists(self):
        """(prompt ids, output ids or None, output length) per request, tokenized once."""
        if self._tokenized is None:
            out = []
            for req in self.trace.requests:
                req: TextRequest
                prompt = self.tokenizer.prompt_ids(req)
                if not prompt:
                    raise ValueError(f"{self.trace.path}:{req.line}: the prompt tokenizes "
                                     "to no tokens")
                outs = self.tokenizer.output_ids(req) if self.include_outputs else None
                m = 0
                if self.include_outputs:
                    m = len(outs) if outs is not None else (req.output_length or 0)
                out.append((prompt, outs, m))
            self._tokenized = out
        return self._tokenized

    def _text_tokens(self) -> Iterator[ReplayItem]:
        base = tk.TEXT_OUTPUT_BASE
        for prompt, outs, m in self._text_token_lists():
            full = None
            if m:
                if outs is None:
                    outs = tk.output_tokens(base, m).tolist()
                    base += m
                full = prompt + list(outs)
            yield ReplayItem(len(prompt), m, prompt, full)

    def _text_blocks(self) -> Iterator[ReplayItem]:
        ps = self.space.page_size
        chain = _PageChain()
        base = tk.TEXT_OUTPUT_BASE
        for prompt, outs, m in self._text_token_lists():
            keys = interleave_mark(np.asarray(chain.symbols(prompt, ps), dtype=np.int64))
            full = None
            if m:
                if outs is None:
                    outs = tk.output_tokens(base, m).tolist()
                    base += m
                full = interleave_mark(np.asarray(chain.symbols(prompt + list(outs), ps),
                                                  dtype=np.int64))
            yield ReplayItem(len(prompt), m, keys, full)


class _PageChain:
    """Chained page ids for text: equal ids <=> equal pages after equal prefixes."""

    def __init__(self):
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def symbols(self, tokens: Sequence[int], page_size: int) -> list[int]:
        out: list[int] = []
        parent = -1
        for start in range(0, len(tokens), page_size):
            key = (parent, tuple(tokens[start:start + page_size]))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out
