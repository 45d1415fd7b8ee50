"""TextStream: stop tokens, stop strings across tokens, held-back text, length.

The reference is a brute-force character-by-character scan of the whole text.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.text_stream import StreamDelta, TextStream

EOS = 0


class FakeDetokenizer:
    """Token id -> text table; records what it was asked to decode."""

    def __init__(self, table: dict[int, str]):
        self.table = table
        self.pushed: list[int] = []

    def push(self, token_id: int) -> str:
        self.pushed.append(token_id)
        return self.table[token_id]


class LaggingDetokenizer(FakeDetokenizer):
    """Holds each token's text until the next token, like a character split over tokens;
    flush() gives back what is still pending at the end."""

    def __init__(self, table: dict[int, str]):
        super().__init__(table)
        self.pending = ""

    def push(self, token_id: int) -> str:
        out, self.pending = self.pending, super().push(token_id)
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def reference(texts: list[str], ids: list[int], params: SamplingParams,
              eos: frozenset[int]) -> tuple[str, str | None, str | int | None]:
    """Final text, finish reason, stop reason: scan the text one character at a time."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    text = ""
    for n, (tok, piece) in enumerate(zip(ids, texts), start=1):
        if tok in stop_ids:
            return text, "stop", tok
        for ch in piece:
            text += ch
            hits = [s for s in params.stop if text.endswith(s)]
            if hits:
                stop = max(hits, key=len)            # the one that started first
                cut = len(text) - (0 if params.include_stop_str_in_output else len(stop))
                return text[:cut], "stop", stop
        if n >= params.max_tokens:
            return text, "length", None
    return text, None, None


def run(pieces: list[str], params: SamplingParams, ids: list[int] | None = None,
        table_extra: dict[int, str] | None = None, eos=frozenset({EOS})):
    """Push tokens until the stream finishes; return (deltas, stream, detokenizer)."""
    ids = ids if ids is not None else list(range(1, len(pieces) + 1))
    table = dict(zip(ids, pieces)) | (table_extra or {})
    detok = FakeDetokenizer(table)
    stream = TextStream(params, detok, eos)
    deltas: list[StreamDelta] = []
    for n, tok in enumerate(ids, start=1):
        deltas.append(stream.push(tok, n))
        if deltas[-1].finished:
            break
    texts = [table[t] for t in ids]
    want = reference(texts, ids, params, eos)
    got = ("".join(d.text for d in deltas), deltas[-1].finish_reason, deltas[-1].stop_reason)
    assert got == want
    assert all(not d.finished for d in deltas[:-1])
    return deltas, stream, detok


def test_stop_string_inside_one_token():
    deltas, _, _ = run(["Hello", " wor", "ld. STOP here", " more"],
                       SamplingParams(max_tokens=10, stop=["STOP"]))
    assert [d.text for d in deltas] == ["Hello", " wor", "ld. "]
    assert deltas[-1].stop_reason == "STOP" and deltas[-1].finish_reason == "stop"


def test_stop_string_spanning_two_tokens_is_never_shown_in_part():
    deltas, _, _ = run(["a b", "c ST", "OP d"], SamplingParams(max_tokens=10, stop=["STOP"]))
    assert [d.text for d in deltas] == ["a b", "c ", ""]   # "ST" held, then dropped
    assert deltas[-1].finished


def test_stop_string_spanning_three_tokens():
    deltas, _, _ = run(["x<", "|e", "n", "d|>y"], SamplingParams(max_tokens=10, stop=["<|end|>"]))
    assert [d.text for d in deltas] == ["x", "", "", ""]
    assert deltas[-1].stop_reason == "<|end|>"


def test_include_stop_string_in_output():
    deltas, _, _ = run(["x<", "|e", "n", "d|>y"], SamplingParams(
        max_tokens=10, stop=["<|end|>"], include_stop_str_in_output=True))
    assert "".join(d.text for d in deltas) == "x<|end|>"


def test_held_text_released_when_match_fails():
    deltas, _, _ = run(["a S", "T", "x", "STO", "!"], SamplingParams(max_tokens=5, stop=["STOP"]))
    assert [d.text for d in deltas] == ["a ", "", "STx", "", "STO!"]
    assert deltas[-1].finish_reason == "length"


def test_earlier_occurrence_wins_whatever_the_list_order():
    for stop in (["END", "X"], ["X", "END"]):
        deltas, _, _ = run(["a X b END c"], SamplingParams(max_tokens=3, stop=stop))
        assert deltas[-1].stop_reason == "X" and deltas[-1].text == "a "
    # Across tokens: "bc" completes before "abcd" does, so it wins though it starts later.
    deltas, _, _ = run(["xa", "bc", "d"], SamplingParams(max_tokens=5, stop=["abcd", "bc"]))
    assert deltas[-1].stop_reason == "bc" and "".join(d.text for d in deltas) == "xa"


def test_eos_stops_without_its_text_unless_ignored():
    table = {EOS: "</s>"}
    deltas, _, detok = run(["Hi", " there", "</s>", "!"], SamplingParams(max_tokens=4),
                           ids=[1, 2, EOS, 3], table_extra=table)
    assert [d.text for d in deltas] == ["Hi", " there", ""]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", EOS)
    assert EOS not in detok.pushed
    deltas, _, _ = run(["Hi", " there", "</s>", "!"], SamplingParams(max_tokens=4, ignore_eos=True),
                       ids=[1, 2, EOS, 3], table_extra=table)
    assert "".join(d.text for d in deltas) == "Hi there</s>!"
    assert deltas[-1].finish_reason == "length" and len(deltas) == 4


def test_stop_token_ids_flush_held_text():
    params = SamplingParams(max_tokens=9, stop=["STOP"], stop_token_ids=[7], ignore_eos=True)
    deltas, _, detok = run(["ok S", "T", "<7>", "z"], params, ids=[1, 2, 7, 3])
    assert [d.text for d in deltas] == ["ok ", "", "ST"]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", 7)
    assert 7 not in detok.pushed


def test_length_finish_flushes_held_text():
    deltas, _, _ = run(["abc", " <|e"], SamplingParams(max_tokens=2, stop=["<|end|>"]))
    assert [d.text for d in deltas] == ["abc", " <|e"]
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_reason is None


def test_tokens_that_complete_no_character_yet():
    # A detokenizer returns "" while a UTF-8 character is incomplete.
    deltas, _, _ = run(["caf", "", "é S", "", "TOP"], SamplingParams(max_tokens=9, stop=["STOP"]))
    assert "".join(d.text for d in deltas) == "café "


def test_finish_flushes_pending_detokenizer_text():
    params = SamplingParams(max_tokens=3, stop=["<|end|>"])
    # Length: the last token's text, still inside the detokenizer, goes out.
    stream = TextStream(params, LaggingDetokenizer({1: "ab", 2: " <|e", 3: "n"}), frozenset())
    assert [stream.push(t, n).text for n, t in enumerate([1, 2], 1)] == ["", "ab"]
    last = stream.push(3, 3)
    assert (last.text, last.finish_reason) == (" <|en", "length")
    # Stop token: pending text before it goes out, the stop token's own text does not.
    stream = TextStream(params, LaggingDetokenizer({1: "ab", 2: "c", EOS: "</s>"}),
                        frozenset({EOS}))
    texts = [stream.push(t, n) for n, t in enumerate([1, 2, EOS], 1)]
    assert "".join(d.text for d in texts) == "abc"
    assert (texts[-1].finish_reason, texts[-1].stop_reason) == ("stop", EOS)
    # A stop string completed by the flushed text still stops, and is cut.
    stream = TextStream(params, LaggingDetokenizer({1: "ab <|e", 2: "nd|>z"}), frozenset())
    texts = [stream.push(1, 1), stream.push(2, 2)]
    assert texts[-1].finished is False
    end = stream.finish()
    assert "".join(d.text for d in texts + [end]) == "ab "
    assert (end.finish_reason, end.stop_reason) == ("stop", "<|end|>")


def test_engine_initiated_finish_releases_held_text():
    stream = TextStream(SamplingParams(max_tokens=10, stop=["STOP"]),
                        FakeDetokenizer({1: "go S", 2: "T"}), frozenset())
    assert stream.push(1, 1).text == "go "
    assert stream.push(2, 2).text == ""
    end = stream.finish()
    assert (end.text, end.finish_reason, end.stop_reason) == ("ST", "length", None)
    with pytest.raises(RuntimeError):
        stream.finish()


def test_push_after_finish_is_an_error():
    stream = TextStream(SamplingParams(max_tokens=1), FakeDetokenizer({1: "a"}), frozenset())
    assert stream.push(1, 1).finished
    with pytest.raises(RuntimeError):
        stream.push(1, 2)


def test_held_text_stays_bounded_on_long_outputs():
    """Only the held tail (shorter than the longest stop string) is carried between tokens,
    so the work per token does not grow with the output."""
    stop = ["STOP!", "<|im_end|>"]
    pieces = ["S", "T", "O", "P", " <|im", "_en", "d", " x"] * 500
    deltas, _, _ = run(pieces, SamplingParams(max_tokens=len(pieces), stop=stop))
    assert deltas[-1].finish_reason == "length"
    stream2 = TextStream(SamplingParams(max_tokens=10**6, stop=stop),
                         FakeDetokenizer(dict(enumerate(pieces))), frozenset())
    for n, tok in enumerate(range(len(pieces)), start=1):
        stream2.push(tok, n)
        assert len(stream2.held_text) < max(map(len, stop))


def longest_partial(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab c", max_size=4), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    max_tokens=st.integers(1, 14),
    include=st.booleans(),
    stop_at=st.one_of(st.none(), st.integers(0, 11)),
    lagging=st.booleans(),
)
def test_matches_brute_force_reference(pieces, stops, max_tokens, include, stop_at, lagging):
    ids = list(range(1, len(pieces) + 1))
    stop_ids = [ids[stop_at]] if stop_at is not None and stop_at < len(ids) else []
    params = SamplingParams(max_tokens=max_tokens, stop=stops, include_stop_str_in_output=include,
                            stop_token_ids=stop_ids)
    detok = (LaggingDetokenizer if lagging else FakeDetokenizer)(dict(zip(ids, pieces)))
    stream = TextStream(params, detok, frozenset())
    emitted = ""
    for n, tok in enumerate(ids, start=1):
        delta = stream.push(tok, n)
        emitted += delta.text
        if delta.finished:
            break
        generated = "".join(pieces[:n - 1] if lagging else pieces[:n])   # decoded so far
        # Exactly the tail that may still start a stop string is held back, nothing more.
        assert emitted + stream.held_text == generated
        assert len(stream.held_text) == longest_partial(generated, stops)
    want = reference(pieces, ids, params, frozenset())
    if delta.finished:
        assert (emitted, delta.finish_reason, delta.stop_reason) == want
    else:   # ran out of tokens first: the engine ends the sample
        end = stream.finish()
        text, reason, stop_reason = want
        assert (emitted + end.text, end.finish_reason, end.stop_reason) == (
            text, "length" if reason is None else reason, stop_reason)
