"""Tool calls out of generated text, whole or streamed: the Hermes/Qwen format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what forced calls generate and
the default tools prompt asks for) and Llama 3's bare JSON (`{"name": ..., "parameters":
{...}}`, several separated by ';'). Text that is not a call of a known tool stays text.

`ToolCallStream` splits a sample's streamed text into content deltas and finished calls: it
holds back only what could still become a `<tool_call>` tag, and (for Llama 3's format) an
output that starts with '{' until the sample ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text, as OpenAI sends it


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


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content None when only calls were made."""
    if OPEN in text:
        calls, pieces, end = [], [], 0
        for m in _BLOCK.finditer(text):
            call = _json_call(m.group(1), names)
            if call is None:
                continue
            calls.append(call)
            pieces.append(text[end:m.start()])
            end = m.end()
        if calls:
            content = ("".join(pieces) + text[end:]).strip()
            return content or None, calls
        return text, []
    stripped = text.strip().removeprefix("<|python_tag|>")
    if stripped.startswith("{"):
        calls = [_json_call(part, names) for part in stripped.split(";")]
        if calls and all(c is not None for c in calls):
            return None, calls          # type: ignore[return-value]
    return text, []


@dataclass
class ToolCallStream:
    """One sample's streamed text -> content deltas and calls, as they complete."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""                 # text not yet released
    _in_block: bool = False
    _json_mode: bool | None = None  # None: undecided (nothing but whitespace yet)

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        if self._json_mode is None and self._held.strip():
            self._json_mode = self._held.lstrip().startswith(("{", "<|python_tag|>"))
        if self._json_mode or self._json_mode is None:
            return "", []
        content, new = [], []
        while True:
            if self._in_block:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                block = self._held[:end + len(CLOSE)]
                self._held = self._held[end + len(CLOSE):]
                self._in_block = False
                call = _json_call(block[len(OPEN):-len(CLOSE)].strip(), self.names)
                if call is None:
                    content.append(block)
                else:
                    new.append(call)
                    self._held = self._held.lstrip("\n") if not self._held.strip() else self._held
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                content.append(self._held[:start])
                self._held = self._held[start:]
                self._in_block = True
                continue
            keep = _partial_tag(self._held)
            content.append(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            break
        self.calls.extend(new)
        text_out = "".join(content)
        if self.calls and not text_out.strip():
            text_out = ""
        return text_out, new

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """`push`, and at the sample's end `finish` too: everything released by this output."""
        out, calls = self.push(text)
        if finished:
            more_text, more_calls = self.finish()
            out, calls = out + more_text, calls + more_calls
        return out, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The sample ended: what is still held, as content or calls."""
        held, self._held = self._held, ""
        if not held:
            return "", []
        if self._json_mode or self._in_block:
            content, calls = parse_calls(held, self.names)
            self.calls.extend(calls)
            return content or "", calls
        return held, []


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that starts `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
