"""FrameRing (events/frame_ring.py), two mappings of one file as the engine and the child
hold it: the bytes come out as they went in, in order, across the ring's end; room is
what the reader has not taken; the sleeping flag crosses over."""

from __future__ import annotations

import random
import tempfile

from radixserve.events.frame_ring import FrameRing


def pair(size: int) -> tuple[FrameRing, FrameRing, object]:
    f = tempfile.TemporaryFile()
    return FrameRing(f.fileno(), size, create=True), FrameRing(f.fileno(), size, False), f


def test_bytes_come_out_in_order_across_the_end_and_room_is_what_is_not_taken():
    engine, child, f = pair(97)             # a size no put lines up with
    rng = random.Random(3)
    sent, got = bytearray(), bytearray()
    try:
        for _ in range(2000):
            if rng.random() < 0.6:
                n = rng.randint(0, engine.room())
                data = bytes(rng.randrange(256) for _ in range(n))
                engine.put(data)
                sent += data
            else:
                got += child.take()
            assert engine.room() == 97 - (len(sent) - len(got))
            assert child.pending() == len(sent) - len(got)
        got += child.take()
        assert got == sent and len(sent) > 20 * 97     # wrapped many times
        assert child.take() == b"" and engine.room() == 97
    finally:
        engine.close()
        child.close()
        f.close()


def test_the_sleeping_flag_crosses_over():
    engine, child, f = pair(16)
    try:
        assert not engine.child_sleeping()
        child.set_sleeping(True)
        assert engine.child_sleeping()
        child.set_sleeping(False)
        assert not engine.child_sleeping()
    finally:
        engine.close()
        child.close()
        f.close()
