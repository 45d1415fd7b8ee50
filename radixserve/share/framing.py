"""A shared page's bytes: the disk format's checked header (storage/checked_blob.py) in
front of the page payload, with the full 16-byte entry key in it.

Both stores keep pages framed, so a loaded page is checked the same way whichever store it
came from: CRC32C over the payload, and the key it was published under equal to the key it
was asked for (a file renamed or an object registered under the wrong key is refused).
"""

from __future__ import annotations

from radixserve.storage.checked_blob import (HEADER, BadBlob, check_header, check_payload,
                                             pack_header)

__all__ = ["BadBlob", "MAGIC", "frame", "unframe"]

MAGIC = b"RSXSHARE"


def _halves(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")


def frame(key: bytes, payload: bytes) -> bytes:
    low, high = _halves(key)
    return pack_header(MAGIC, low, payload, serial=high) + payload


def unframe(key: bytes, blob: bytes | memoryview) -> bytes:
    """The payload of `blob`, checked against `key`; BadBlob (saying why) otherwise."""
    low, high = _halves(key)
    view = memoryview(blob)
    length, crc = check_header(MAGIC, low, bytes(view[:HEADER.size]), serial=high)
    payload = bytes(view[HEADER.size:HEADER.size + length])
    check_payload(payload, length, crc, trailing=len(view) > HEADER.size + length)
    return payload
