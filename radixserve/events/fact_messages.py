"""The engine -> publisher process pipe: each step's tree facts as ONE length-prefixed
msgpack message (process_publisher.py writes, child.py reads).

A message is `plain` facts (tree_facts.py: tuples of ints, packed keys as bytes, strings)
encoded by one msgspec call, so the engine's share of publishing is that call and a pipe
write; the shadow tree, the block hashes, the events and their encoding run in the child.
The child decodes to lists where the engine had tuples: FactReplay reads both alike.
"""

from __future__ import annotations

import msgspec

from radixserve.events.tree_facts import plain

__all__ = ["FactEncoder", "FrameReader", "decode_facts"]

_LENGTH_BYTES = 4


class FactEncoder:
    """Encodes the facts of one step (TreeFacts.take or tree_facts.snapshot) as a frame."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()

    def frame(self, facts: list[tuple]) -> bytes:
        payload = self._encoder.encode(plain(facts))
        return len(payload).to_bytes(_LENGTH_BYTES, "little") + payload


def decode_facts(payload: bytes) -> list:
    """One frame's payload back into facts (lists) FactReplay applies."""
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
            frames.append(bytes(buf[at + _LENGTH_BYTES:end]))
            at = end
        del buf[:at]
        return frames

    @property
    def partial(self) -> int:
        """Bytes of a frame not complete yet (at the pipe's end: a writer that died)."""
        return len(self._buffer)
