"""Token ids for replay: synthesized for hash-id traces, tokenized for text traces.

Hash-id traces carry no tokens, so each block id gets ``block_size`` token ids of its own:
token ``j`` of block ``b`` is ``b * block_size + j``. The map is a bijection, so no two
blocks share a token (requests diverge exactly on block boundaries, never a few tokens
later by chance) and a token names its block (Belady in token mode reads a node's block
from its last token). Output tokens are fresh ids above every prompt token, one run per
request, so no other request ever matches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .traces import HashRequest, TextRequest

TOKEN_DTYPE = np.int64
# Synthesized output tokens of text traces start here: above any real vocabulary.
TEXT_OUTPUT_BASE = 1 << 40


def block_tokens(block_id: int, block_size: int) -> np.ndarray:
    """The ``block_size`` token ids standing for one block (deterministic in the id)."""
    start = block_id * block_size
    return np.arange(start, start + block_size, dtype=TOKEN_DTYPE)


def hash_prompt_tokens(req: HashRequest, block_size: int) -> np.ndarray:
    """A hash-id request's prompt: its blocks' tokens, concatenated, cut at input_length."""
    ids = np.asarray(req.hash_ids, dtype=TOKEN_DTYPE)
    grid = ids[:, None] * block_size + np.arange(block_size, dtype=TOKEN_DTYPE)[None, :]
    return grid.reshape(-1)[: req.input_length]


def output_tokens(base: int, num_tokens: int) -> np.ndarray:
    """``num_tokens`` fresh ids from ``base`` (the caller advances base per request)."""
    return np.arange(base, base + num_tokens, dtype=TOKEN_DTYPE)


def hash_output_base(max_block_id: int, block_size: int) -> int:
    """First id above every synthesized prompt token of a trace."""
    return (max_block_id + 1) * block_size


class TextTokenizer:
    """Turns text-trace requests into token ids with the chosen model's tokenizer.

    The tokenizer is loaded on first use only, so traces of ``input_ids`` (and hash-id
    traces) never import the model package or torch.
    """

    def __init__(self, model: str):
        self.model = model
        self._tok = None

    @property
    def tokenizer(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.model)
        return self._tok

    def prompt_ids(self, req: TextRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        if req.messages is not None:
            return list(self.tokenizer.apply_chat_template(req.messages,
                                                           add_generation_prompt=True))
        return list(self.tokenizer.encode(req.prompt))

    def output_ids(self, req: TextRequest) -> Sequence[int] | None:
        """Recorded output ids, or None when only a length (or nothing) is known."""
        if req.output_ids is not None:
            return list(req.output_ids)
        if req.output is not None:
            return list(self.tokenizer.encode(req.output))
        return None


def load_tokenizer(model: str):
    """The model's tokenizer, without its weights (nor torch): see model.load_tokenizer."""
    from radixserve.model import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(model)
