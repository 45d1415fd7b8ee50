"""One sample's outgoing text: detokenize, apply stop tokens and stop strings, hold back.

Stop strings can span tokens, so the stream keeps back the trailing text that could still
become the start of a stop string; a client never sees part of one. Only that held tail
plus the newest token's text is ever searched, so the cost per token does not grow with
the length of the output.

When several stop strings occur, the one that is complete first in the text (earliest end,
then earliest start) wins: that is the one a character-by-character stream would stop
at, so the result does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from radixserve.engine.sampling_params import SamplingParams


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...   # newly completed text only
    # Optional: def flush(self) -> str, the text still pending at the end (called once).


@dataclass(slots=True)
class StreamDelta:
    text: str                   # text safe to emit now (never a possible stop-string prefix)
    finished: bool
    finish_reason: str | None   # "stop" | "length"
    stop_reason: str | int | None


class TextStream:
    """Per-sample stop logic; the engine calls push once for every token it samples."""

    def __init__(self, params: SamplingParams, detokenizer: Detokenizer,
                 eos_token_ids: frozenset[int]):
        self._detokenizer = detokenizer
        self._max_tokens = params.max_tokens
        self._stop = tuple(dict.fromkeys(params.stop))      # de-duplicated, order kept
        self._include_stop = params.include_stop_str_in_output
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= eos_token_ids
        self._stop_ids = frozenset(stop_ids)
        self._held = ""             # generated text not yet emitted
        self.finished = False

    @property
    def held_text(self) -> str:
        """Text kept back because it may begin a stop string (shorter than the longest)."""
        return self._held

    def push(self, token_id: int, num_generated: int) -> StreamDelta:
        """Account for one new token; num_generated counts it (1 for the first token)."""
        if self.finished:
            raise RuntimeError("push() on a finished TextStream")
        if token_id in self._stop_ids:
            return self._end("stop", token_id)      # the stop token's text is never emitted
        delta = self._take(self._detokenizer.push(token_id))
        if not delta.finished and num_generated >= self._max_tokens:
            return self._end("length", None, delta.text)
        return delta

    def finish(self, reason: str = "length") -> StreamDelta:
        """The rest of the text when the engine ends the sample itself (context full)."""
        if self.finished:
            raise RuntimeError("finish() on a finished TextStream")
        return self._end(reason, None)

    def _take(self, new: str) -> StreamDelta:
        """Add decoded text: finish at a stop string, else emit all but the held tail."""
        text = self._held + new
        match = self._find_stop(text, len(self._held))
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop else start
            return self._finish(text[:end], "stop", stop)
        hold = self._partial_stop_len(text)
        self._held = text[len(text) - hold:] if hold else ""
        return StreamDelta(text[:len(text) - hold], False, None, None)

    def _end(self, reason: str, stop_reason: str | int | None, emitted: str = "") -> StreamDelta:
        """Finish for a stop token or length: nothing more can follow, so the detokenizer's
        pending text and the held tail go out (unless they complete a stop string)."""
        flush = getattr(self._detokenizer, "flush", None)
        delta = self._take(flush() if flush is not None else "")
        if delta.finished:
            return StreamDelta(emitted + delta.text, True, "stop", delta.stop_reason)
        return self._finish(emitted + delta.text + self._held, reason, stop_reason)

    def _finish(self, text: str, reason: str, stop_reason: str | int | None) -> StreamDelta:
        self.finished = True
        self._held = ""
        return StreamDelta(text, True, reason, stop_reason)

    def _find_stop(self, text: str, old_len: int) -> tuple[int, str] | None:
        """The stop string completed first in text, looking only at matches that end in
        text[old_len:] (the held part was searched before and held no match)."""
        best: tuple[int, int, str] | None = None     # (end, start, stop)
        for stop in self._stop:
            start = text.find(stop, max(0, old_len - len(stop) + 1))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        hold = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        return hold
