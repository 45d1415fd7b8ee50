"""The engine -> publisher process pipe: each step's tree facts as ONE length-prefixed
msgpack message (process_publisher.py writes, child.py reads).

TreeFacts' facts are tuples of ints, strings and packed keys (tree_facts.py), so a step
is one msgspec encode on the engine's thread; the child decodes them (tuples come back as
lists, which FactReplay reads alike) and does all the per-fact work.
"""

from __future__ import annotations

import msgspec

__all__ = ["FactEncoder", "FrameReader", "decode_facts"]

_LENGTH_BYTES = 4


class FactEncoder:
    """Encodes the facts of one step (TreeFacts.take or tree_facts.snapshot) as a frame."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()

    def frame(self, facts: list[tuple]) -> bytes:
        payload = self._encoder.encode(facts)
        return len(payload).to_bytes(_LENGTH_BYTES, "little") + payload


def decode_facts(payload: bytes) -> list:
    """One frame's payload back into facts FactReplay applies."""
    return msgspec.msgpack.decode(payload)


class FrameReader:
    """Splits the bytes read from the pipe, in whatever pieces they come, into frames."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append `data`; return the payloads of the frames now complete, in order."""
        buf = self._buffer
        buf += data
        frames, at = [], 0
        while len(buf) - at >= _LENGTH_BYTES:
            size = int.from_bytes(buf[at:at + _LENGTH_BYTES], "little")
            end = at + _LENGTH_BYTES + size
            if end > len(buf):
                break
            frames.append(bytes(buf[at:end][_LENGTH_BYTES:]))
            at = end
        del buf[:at]
        return frames

    @property
    def partial(self) -> int:
        """Bytes of a frame not complete yet (at the pipe's end: a writer that died)."""
        return len(self._buffer)
