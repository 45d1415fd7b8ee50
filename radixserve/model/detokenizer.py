"""Incremental detokenization that never emits half a character.

Byte-level BPE splits a Chinese character or an emoji across tokens; decoding a token on
its own yields U+FFFD. We decode a short window ending at the newest token and emit only
the text beyond what the window's older part already produced, and only when it does not
end in U+FFFD (the prefix/read-offset technique of vLLM and TGI). Decoding a window rather
than single tokens also keeps SentencePiece's leading-space handling right.
"""

from __future__ import annotations

from typing import Callable, Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5      # prompt tokens kept as left context for the first window
_COMPACT_AFTER = 256     # drop consumed ids once this many pile up


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(prompt_ids)[-_PROMPT_CONTEXT:]
        self._prefix = 0                  # window start: text before it is already out
        self._read = len(self._ids)       # text of ids[prefix:read] is already out

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (possibly "")."""
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith(_REPLACEMENT):
            return ""                     # nothing new yet, or a character is incomplete
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > _COMPACT_AFTER:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return text[len(done):]

    def flush(self) -> str:
        """Text still held back at the end of a stream (an incomplete character shows as
        U+FFFD, as a full decode would show it). Call once when the sequence finishes."""
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(done):] if len(text) > len(done) else ""
