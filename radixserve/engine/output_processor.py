"""OutputProcessor: everything on the way out of a step, so the scheduler only schedules.

After each step the scheduler reports the tokens it appended and the sequences it retired
on its own (aborted, failed). This module turns that into what callers receive: incremental
detokenizing, stop tokens, stop strings and length limits (one `TextStream` per sample),
`RequestOutput` deltas, the final event with `Usage`, and the output counters. Its stop
checks decide when a sample is done; it returns those samples and the engine has the
scheduler retire them, in the same event-loop turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from radixserve.engine.batch import StepUpdate
from radixserve.engine.outputs import EngineStats, RequestOutput, Usage
from radixserve.engine.request import Request, SeqState
from radixserve.engine.text_stream import Detokenizer, TextStream


class DetokenizerSource(Protocol):
    """What the processor needs of a tokenizer (model.Tokenizer is one)."""

    eos_token_ids: frozenset[int]

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> Detokenizer: ...


@dataclass(slots=True)
class _SampleOutput:
    """Output state of one sample, kept until its final event."""

    stream: TextStream
    first_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: DetokenizerSource, stats: EngineStats, max_model_len: int):
        self.tokenizer = tokenizer
        self.stats = stats
        self.max_model_len = max_model_len
        self._samples: dict[SeqState, _SampleOutput] = {}

    def add(self, request: Request) -> None:
        """Start the output state of each of the request's samples."""
        for seq in request.sequences:
            detok = self.tokenizer.detokenizer(request.prompt_ids)
            stream = TextStream(request.params, detok, self.tokenizer.eos_token_ids)
            self._samples[seq] = _SampleOutput(stream)

    @property
    def num_open(self) -> int:
        """Samples whose final event has not been sent yet."""
        return len(self._samples)

    def on_tokens(self, update: StepUpdate, now: float) -> list[SeqState]:
        """Stream each new token's text; return the samples that just finished (stop token,
        stop string, max_tokens or a full context), whose final event has been sent."""
        finished: list[SeqState] = []
        samples = self._samples
        max_model_len = self.max_model_len
        self.stats.generation_tokens += len(update.tokens)
        for seq, token, logprob in zip(update.seqs, update.tokens, update.logprobs):
            state = samples[seq]
            if state.first_token_time is None:
                state.first_token_time = now
            delta = state.stream.push(token, seq.num_generated)
            text = delta.text
            if not delta.finished and len(seq.token_ids) >= max_model_len:
                delta = state.stream.finish("length")       # the context is full
                text += delta.text
            out = self._output(seq, state, [token], text, now)
            if logprob is not None:
                out.logprobs = [logprob]
            if delta.finished:
                self._mark_final(out, seq, delta.finish_reason, delta.stop_reason)
                finished.append(seq)
            seq.request.emit(out)
        return finished

    def finish(self, seqs: Iterable[SeqState], reason: str, now: float,
               error: BaseException | None = None) -> None:
        """Send the final event of samples the scheduler retired itself ("abort", "error").
        A sample whose final event already went out is skipped."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        for seq in seqs:
            state = self._samples.get(seq)
            if state is None:
                continue
            out = self._output(seq, state, [], "", now)
            self._mark_final(out, seq, reason, None)
            out.error = message
            seq.request.emit(out)

    def _output(self, seq: SeqState, state: _SampleOutput, tokens: list[int], text: str,
                now: float) -> RequestOutput:
        return RequestOutput(request_id=seq.request.request_id, index=seq.index,
                             token_ids=tokens, text=text,
                             arrival_time=seq.request.arrival_time,
                             first_token_time=state.first_token_time, time=now,
                             cached_tokens=seq.prompt_cache_hit)

    def _mark_final(self, out: RequestOutput, seq: SeqState, reason: str | None,
                    stop_reason: str | int | None) -> None:
        del self._samples[seq]
        out.finished = True
        out.finish_reason = reason
        out.stop_reason = stop_reason
        out.usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated,
                          cached_tokens=seq.prompt_cache_hit or 0, miss=seq.miss)
        counts = self.stats.requests_finished
        counts[reason] = counts.get(reason, 0) + 1
