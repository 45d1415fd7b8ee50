"""The engine -> publisher process stream: each step's tree facts as ONE length-prefixed
msgpack message (process_publisher.py puts it into the ring, frame_ring.py; child.py
takes it).

TreeFacts' facts are tuples of ints, strings and packed keys (tree_facts.py), so a step
is one msgspec encode on the engine's thread; the child decodes them (tuples come back as
lists, which FactReplay reads alike) and does all the per-fact work.
"""

from __future__ import annotations

import msgspec

__all__ = ["FactEncoder", "FrameReader", "decode_facts"]

_LENGTH_BYTES = 4
_KEEP_BYTES = 1 << 20       # a reused frame buffer grown past this is let go after use


class FactEncoder:
    """Encodes the facts of one step (TreeFacts.take or tree_facts.snapshot) as a frame."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray(_LENGTH_BYTES)

    def frame(self, facts: list[tuple]) -> bytes:
        return bytes(self.frame_in_buffer(facts))

    def frame_in_buffer(self, facts: list[tuple]) -> bytearray:
        """The frame, encoded into one buffer this encoder reuses: valid until its next
        call (copy it to keep it). The engine's hand-over copies it into the ring at once;
        a fresh payload and a header joined to it cost two ~40 KB allocations and a copy
        per hand-over at 256 running."""
        buf = self._buffer
        self._encoder.encode_into(facts, buf, _LENGTH_BYTES)
        buf[:_LENGTH_BYTES] = (len(buf) - _LENGTH_BYTES).to_bytes(_LENGTH_BYTES, "little")
        if len(buf) > _KEEP_BYTES:      # a snapshot's: not kept once the caller is done
            self._buffer = bytearray(_LENGTH_BYTES)
        return buf


def decode_facts(payload: bytes) -> list:
    """One frame's payload back into facts FactReplay applies."""
    return msgspec.msgpack.decode(payload)


class FrameReader:
    """Splits the bytes taken from the ring, in whatever pieces they come, into frames."""

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
        """Bytes of a frame not complete yet (at the stream's end: a writer that died)."""
        return len(self._buffer)
