"""Trace readers: JSONL request logs in, validated request records out.

Two formats (one JSON object per line, blank lines ignored):

* hash-id traces (Mooncake / Qwen-Bailian): ``input_length``, ``hash_ids`` (one id per
  fixed-size block, chained: equal ids mean equal prefixes), optional ``output_length`` and
  ``timestamp``;
* text traces: exactly one of ``prompt`` (text), ``messages`` (chat) or ``input_ids``, with
  an optional ``output_length``, recorded ``output`` text or ``output_ids``, ``timestamp``.

A bad line is reported as ``path:line: reason``; the caller chooses to stop at the first one
(``TraceError``) or skip it and keep a list of what was skipped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

OnError = Literal["stop", "skip"]
TraceFormat = Literal["auto", "hash", "text"]

# Lengths and token ids a replay can represent: prompts, outputs and token ids live in
# int64 arrays next to synthesized ids (text outputs start at 2**40: tokens.py).
MAX_TOKENS = 1 << 40
MAX_TOKEN_ID = 1 << 40


class TraceError(ValueError):
    """A malformed trace line, named by file and line number."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


class _HashRecord(msgspec.Struct, forbid_unknown_fields=False):
    input_length: int
    hash_ids: list[int]
    output_length: int = 0
    timestamp: float | None = None


class _TextRecord(msgspec.Struct, forbid_unknown_fields=False):
    prompt: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    output_length: int | None = None
    output: str | None = None
    output_ids: list[int] | None = None
    timestamp: float | None = None


@dataclass(frozen=True, slots=True)
class HashRequest:
    """One request of a hash-id trace: ``hash_ids[i]`` names tokens [i*B, (i+1)*B)."""

    line: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    timestamp: float | None


@dataclass(frozen=True, slots=True)
class TextRequest:
    """One request of a text trace; exactly one of prompt / messages / input_ids is set."""

    line: int
    prompt: str | None
    messages: list[dict] | None
    input_ids: tuple[int, ...] | None
    output_length: int | None
    output: str | None
    output_ids: tuple[int, ...] | None
    timestamp: float | None


@dataclass(slots=True)
class Trace:
    """Requests in replay order (by timestamp, stable; file order when none is given)."""

    path: str
    format: Literal["hash", "text"]
    requests: list  # list[HashRequest] | list[TextRequest]
    block_size: int | None = None  # hash traces only
    skipped: list[TraceError] = field(default_factory=list)
    num_lines: int = 0


_hash_decoder = msgspec.json.Decoder(_HashRecord)
_text_decoder = msgspec.json.Decoder(_TextRecord)


def _decode(decoder: msgspec.json.Decoder, raw: bytes, kind: str):
    """The decoded record, or why it could not be decoded (a str)."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        return f"bad {kind} record: {exc}"
    except msgspec.DecodeError as exc:
        return f"invalid JSON: {exc}"


def parse_hash_line(raw: bytes, block_size: int) -> HashRequest | str:
    """Decode and check one hash-id record; returns the reason as a str when it is bad."""
    rec = _decode(_hash_decoder, raw, "hash-id")
    if isinstance(rec, str):
        return rec
    if rec.input_length < 1:
        return f"input_length must be >= 1, got {rec.input_length}"
    if rec.output_length < 0:
        return f"output_length must be >= 0, got {rec.output_length}"
    if max(rec.input_length, rec.output_length) >= MAX_TOKENS:
        return f"input_length and output_length must be < 2**40 tokens"
    need = math.ceil(rec.input_length / block_size)
    if len(rec.hash_ids) != need:
        return (f"{len(rec.hash_ids)} hash_ids but input_length {rec.input_length} needs "
                f"{need} blocks of {block_size} tokens (wrong --block-size?)")
    if rec.timestamp is not None and not math.isfinite(rec.timestamp):
        return "timestamp must be a finite number"
    return HashRequest(0, rec.input_length, rec.output_length, tuple(rec.hash_ids),
                       rec.timestamp)


def parse_text_line(raw: bytes) -> TextRequest | str:
    """Decode and check one text record; returns the reason as a str when it is bad."""
    rec = _decode(_text_decoder, raw, "text")
    if isinstance(rec, str):
        return rec
    given = [name for name in ("prompt", "messages", "input_ids")
             if getattr(rec, name) is not None]
    if len(given) != 1:
        return ("need exactly one of 'prompt', 'messages', 'input_ids'"
                + (f", got {', '.join(given)}" if given else ""))
    if rec.input_ids is not None and (not rec.input_ids or min(rec.input_ids) < 0):
        return "input_ids must be a non-empty list of non-negative integers"
    for name in ("input_ids", "output_ids"):
        ids = getattr(rec, name)
        if ids and (max(ids) >= MAX_TOKEN_ID or min(ids) < 0):
            return f"{name} must be integers in [0, 2**40) (token ids of a vocabulary)"
    if rec.prompt is not None and not rec.prompt:
        return "prompt is empty"
    if rec.messages is not None:
        if not rec.messages:
            return "messages is empty"
        for i, msg in enumerate(rec.messages):
            if not isinstance(msg.get("role"), str) or "content" not in msg:
                return f"messages[{i}] needs a 'role' string and a 'content'"
    if rec.output_length is not None and not 0 <= rec.output_length < MAX_TOKENS:
        return f"output_length must be in [0, 2**40), got {rec.output_length}"
    if rec.timestamp is not None and not math.isfinite(rec.timestamp):
        return "timestamp must be a finite number"
    return TextRequest(0, rec.prompt, rec.messages,
                       None if rec.input_ids is None else tuple(rec.input_ids),
                       rec.output_length, rec.output,
                       None if rec.output_ids is None else tuple(rec.output_ids),
                       rec.timestamp)


def dense_hash_ids(requests: list[HashRequest]) -> list[HashRequest]:
    """The same requests with hash ids renumbered 0, 1, 2, ... in order of first use.

    A trace's ids may be any integers (64-bit hashes, 1e12, beyond 2**64); equal ids stay
    equal and different ids stay different, and every array sized or indexed by an id
    (Belady's next-use index, synthesized token ids) stays as small as the trace.
    """
    dense: dict[int, int] = {}
    out = []
    for r in requests:
        ids = tuple(dense.setdefault(h, len(dense)) for h in r.hash_ids)
        out.append(dataclasses.replace(r, hash_ids=ids))
    return out


def tile_trace(trace: Trace, copies: int) -> Trace:
    """The trace `copies` times over, one copy after another: a bigger trace of the same kind.

    Each copy gets hash ids of its own (offset past the previous copy's), so copies share
    nothing, and timestamps shifted by the trace's span plus one mean gap between requests.
    """
    if copies < 1:
        raise ValueError(f"--tile must be >= 1, got {copies}")
    if copies == 1:
        return trace
    if trace.format != "hash":
        raise ValueError("--tile needs a hash-id trace")
    reqs = trace.requests
    id_step = 1 + max(max(r.hash_ids) for r in reqs)
    stamps = [r.timestamp for r in reqs]
    timed = all(t is not None for t in stamps)
    span = max(stamps) - min(stamps) if timed else 0.0
    shift = span + (span / (len(reqs) - 1) if len(reqs) > 1 else 1.0)
    out = []
    for c in range(copies):
        for r in reqs:
            out.append(dataclasses.replace(
                r, hash_ids=tuple(h + c * id_step for h in r.hash_ids),
                timestamp=r.timestamp + c * shift if timed else None))
    return dataclasses.replace(trace, requests=out)


def _looks_like_hash_trace(raw: bytes) -> bool | None:
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return isinstance(obj, dict) and "hash_ids" in obj


def read_trace(path: str | Path, fmt: TraceFormat = "auto", block_size: int = 512,
               on_error: OnError = "stop", limit: int | None = None) -> Trace:
    """Read a whole trace; ``limit`` keeps the first N good requests (in file order).

    Raises ``TraceError`` at the first bad line when ``on_error == "stop"``, and when the
    file holds no request at all.
    """
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    path = str(path)
    if fmt in ("auto", "hash") and _is_kv_events_recording(path):
        return _recording_trace(path, limit)
    requests: list = []
    skipped: list[TraceError] = []
    kind: str | None = None if fmt == "auto" else fmt
    line_no = 0
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            raw = raw.strip()
            if not raw:
                continue
            if limit is not None and len(requests) >= limit:
                break
            if kind is None:
                guess = _looks_like_hash_trace(raw)
                kind = None if guess is None else ("hash" if guess else "text")
            if kind == "hash":
                parsed = parse_hash_line(raw, block_size)
            elif kind == "text":
                parsed = parse_text_line(raw)
            else:
                parsed = "invalid JSON (cannot tell the trace format from this line)"
            if isinstance(parsed, str):
                err = TraceError(path, line_no, parsed)
                if on_error == "stop":
                    raise err
                skipped.append(err)
                continue
            requests.append(dataclasses.replace(parsed, line=line_no))
    if not requests:
        raise TraceError(path, line_no, "no valid request in the trace")
    if kind == "hash":
        requests = dense_hash_ids(requests)
    # Replay order is timestamp order (stable: ties keep file order); file order when any
    # request has no timestamp.
    if all(r.timestamp is not None for r in requests):
        requests.sort(key=lambda r: r.timestamp)
    return Trace(path, kind, requests, block_size if kind == "hash" else None, skipped,
                 line_no)


def _is_kv_events_recording(path: str) -> bool:
    """Is this a `radixserve kv-events` recording (radixserve/events/recording.py)?"""
    from radixserve.events.recording import is_recording_line

    with open(path, "rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    return is_recording_line(msgspec.json.decode(raw))
                except msgspec.DecodeError:
                    return False
    return False


def _recording_trace(path: str, limit: int | None) -> Trace:
    """A KV events recording as a hash-id trace: one request per run of blocks stored into
    the KV pool, for its whole prefix, at the batch's time (events/recording.py)."""
    from radixserve.events.recording import hash_requests

    block_size, found = hash_requests(path)
    if not found:
        raise TraceError(path, 0, "the recording stores no block into the KV pool")
    requests = [HashRequest(i + 1, len(ids) * block_size, 0, tuple(ids), ts)
                for i, (ts, ids) in enumerate(found[:limit])]
    return Trace(path, "hash", dense_hash_ids(requests), block_size, [], len(found))
