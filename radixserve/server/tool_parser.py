"""Tool calls out of generated text, whole or streamed: the Hermes/Qwen format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what forced calls generate and
the default tools prompt asks for) and Llama 3's bare JSON (`{"name": ..., "parameters":
{...}}`, several separated by ';'). Text that is not a call of a known tool stays text.

`ToolCallStream` turns a sample's streamed text into ordered events: content text, and for
each call `CallStarted` (id and name, as soon as the name is complete), `ArgumentsDelta`
fragments of the arguments as they are generated, and `CallDone`. It holds back only what
could still become a `<tool_call>` tag, and (for Llama 3's format) an output that starts
with '{' until the sample ends. `parse_calls` runs the same stream over a whole output, so a
streamed call's joined fragments always equal the non-streamed `arguments`: the arguments
object exactly as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A Hermes block's head up to its arguments value: the call can start streaming here.
_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                   r'"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int                  # the call's position among this sample's calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallDone:
    index: int
    call: ToolCall


Event = Text | CallStarted | ArgumentsDelta | CallDone


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(obj: object, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _json_call(text: str, names: set[str]) -> ToolCall | None:
    try:
        return _call(json.loads(text), names)
    except ValueError:
        return None


def _bare_json_calls(text: str, names: set[str]) -> list[ToolCall]:
    """Llama 3's format: the whole output is `;`-separated call objects (or it is text).
    Each object is decoded whole, so a ';' inside an argument string is no separator."""
    rest = text.strip().removeprefix("<|python_tag|>").lstrip()
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    while rest.startswith("{"):
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return []
        call = _call(obj, names)
        if call is None:
            return []
        calls.append(call)
        rest = rest[end:].lstrip()
        if not rest.startswith(";"):
            break
        rest = rest[1:].lstrip()
    return calls if not rest else []


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content None when only calls were made."""
    stream = ToolCallStream(names)
    pieces = [e.text for e in stream.feed(text, True) if isinstance(e, Text)]
    if not stream.calls:
        return text, []
    return "".join(pieces).strip() or None, stream.calls


class _ValueEnd:
    """Finds where a JSON object that starts at offset 0 ends, fed a piece at a time."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.seen = 0, False, False, 0

    def feed(self, text: str) -> int | None:
        """Scan `text` (the characters after those already fed): the offset in the whole
        value just past its end, or None while it is still open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.seen += i + 1
                    return self.seen
        self.seen += len(text)
        return None


@dataclass
class _Block:
    """The `<tool_call>` block being received (it starts `_held`)."""

    started: CallStarted | None = None  # its head was read: the arguments stream
    args_at: int = 0                    # offset of the arguments in the block's text
    sent: int = 0                       # arguments characters released so far
    args_end: int | None = None         # offset just past the arguments, once read
    scanner: _ValueEnd = field(default_factory=_ValueEnd)


@dataclass
class ToolCallStream:
    """One sample's streamed text -> ordered content and call events."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""                 # text not yet released
    _block: _Block | None = None    # inside a `<tool_call>` block
    _json_mode: bool | None = None  # None: undecided (nothing but whitespace yet)

    def push(self, text: str) -> list[Event]:
        self._held += text
        if self._json_mode is None and self._held.strip():
            self._json_mode = self._held.lstrip().startswith(("{", "<|python_tag|>"))
        if self._json_mode or self._json_mode is None:
            return []
        events: list[Event] = []
        while True:
            if self._block is not None:
                if not self._advance_block(events):
                    break
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                self._text(self._held[:start], events)
                self._held = self._held[start:]
                self._block = _Block()
                continue
            keep = len(self._held) - _partial_tag(self._held)
            self._text(self._held[:keep], events)
            self._held = self._held[keep:]
            break
        return events

    def feed(self, text: str, finished: bool) -> list[Event]:
        """`push`, and at the sample's end `finish` too: everything released by this output."""
        events = self.push(text)
        return events + self.finish() if finished else events

    def finish(self) -> list[Event]:
        """The sample ended: what is still held, as content or calls (a call cut short, by
        `max_tokens` say, ends with the arguments it has)."""
        held, block, self._held, self._block = self._held, self._block, "", None
        events: list[Event] = []
        if block is not None and block.started is not None:
            end = block.args_end if block.args_end is not None else len(held)
            self._end_call(block, held, end, events)
        elif self._json_mode and (calls := _bare_json_calls(held, self.names)):
            for call in calls:
                self._whole_call(call, events)
        elif block is not None and (call := _json_call(_inner(held), self.names)):
            self._whole_call(call, events)
        else:
            self._text(held, events)
        return events

    # -- inside a block

    def _advance_block(self, events: list[Event]) -> bool:
        """Release what the held block allows; True when the block closed."""
        block = self._block
        assert block is not None
        if block.started is None and (head := _HEAD.match(self._held)) is not None \
                and (name := _name(head.group(1))) in self.names:
            block.started = CallStarted(len(self.calls), new_call_id(), name)
            block.args_at = head.end()
            self.calls.append(ToolCall(block.started.id, name, ""))
            events.append(block.started)
        if block.started is None:           # not streamable (yet): parsed whole when closed
            close = self._held.find(CLOSE, len(OPEN))
        else:
            if block.args_end is None:
                end = block.scanner.feed(self._held[block.args_at + block.scanner.seen:])
                upto = len(self._held) if end is None else block.args_at + end
                self._args_delta(block, self._held, upto, events)
                if end is None:
                    return False
                block.args_end = upto
            close = self._held.find(CLOSE, block.args_end)
        if close < 0:
            return False
        whole, self._held = self._held[:close + len(CLOSE)], self._held[close + len(CLOSE):]
        self._block = None
        if block.started is not None:
            self._end_call(block, whole, block.args_end or 0, events)
        elif (call := _json_call(_inner(whole), self.names)) is not None:
            self._whole_call(call, events)
        else:
            self._text(whole, events)
        if not self._held.strip():
            self._held = self._held.lstrip("\n")
        return True

    def _args_delta(self, block: _Block, source: str, upto: int, events: list[Event]) -> None:
        fragment = source[block.args_at + block.sent:upto]
        if fragment and block.started is not None:
            block.sent += len(fragment)
            events.append(ArgumentsDelta(block.started.index, fragment))

    def _end_call(self, block: _Block, source: str, end: int, events: list[Event]) -> None:
        started = block.started
        assert started is not None
        self._args_delta(block, source, end, events)
        call = ToolCall(started.id, started.name, source[block.args_at:end])
        self.calls[started.index] = call
        events.append(CallDone(started.index, call))

    def _whole_call(self, call: ToolCall, events: list[Event]) -> None:
        """A call parsed in one piece: the same three events a streamed one gets."""
        index = len(self.calls)
        self.calls.append(call)
        events += [CallStarted(index, call.id, call.name), ArgumentsDelta(index, call.arguments),
                   CallDone(index, call)]

    def _text(self, text: str, events: list[Event]) -> None:
        if text and not (self.calls and not text.strip()):
            events.append(Text(text))


def _inner(block: str) -> str:
    """A block's JSON: between the tags (the closing one may be missing)."""
    return block.removeprefix(OPEN).removesuffix(CLOSE).strip()


def _name(quoted: str) -> str | None:
    try:
        return json.loads(quoted)
    except ValueError:
        return None


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that starts `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
