"""The SharedStore protocol: publish a page once, find how far a prefix is published, fetch.

Keys are entry keys (keys.py), one per page, in path order: key i names page i of a prompt
with everything before it, so "how far is this prefix published" is a count of leading
keys. Implementations: dir_store.DirSharedStore (`--kv-share dir:PATH`) and
ray_store.RaySharedStore (`--kv-share ray`). Every method may be called from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from .framing import BadBlob, unframe

__all__ = ["Claim", "Fetched", "ShareCounters", "SharedStore", "open_shared_store",
           "parse_share"]


@dataclass
class Fetched:
    """The leading pages a fetch got (payloads checked against their keys); `refused`:
    pages found but corrupt or under another key (the fetch stopped at the first one);
    `lost`: pages listed but gone (a dead owner's object, a file evicted meanwhile)."""

    payloads: list[bytes] = field(default_factory=list)
    bytes_moved: int = 0
    refused: int = 0
    lost: int = 0

    def add(self, key: bytes, blob: bytes) -> bool:
        """Check one fetched page against its key (framing.py): its payload kept (True),
        or counted as refused (False: the fetch stops there)."""
        try:
            payload = unframe(key, blob)
        except BadBlob:
            self.refused += 1
            return False
        self.payloads.append(payload)
        self.bytes_moved += len(blob)
        return True


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer to a claim on a prompt's unpublished pages (SharedStore.claim).

    `claimed`: leading keys this owner now claims (new, or its own already). `held_until`:
    set when the first key is claimed by another live owner: the wall-clock time
    (`time.time()`) its claim expires. A replica that sees it may wait for that owner's
    publication instead of computing the same pages (engine/peer_share.py)."""

    claimed: int = 0
    held_until: float | None = None


@dataclass
class ShareCounters:
    """What one replica's store did, cumulative (for /cache/stats and /metrics)."""

    published_pages: int = 0        # pages this replica put into the store
    duplicate_pages: int = 0        # publishes that found the page there already
    forgotten_pages: int = 0        # entries this replica saw go (evicted, lost owner)
    refused_pages: int = 0          # fetched pages refused: CRC or key mismatch
    bytes_published: int = 0
    bytes_fetched: int = 0

    def add_fetch(self, got: Fetched) -> None:
        self.refused_pages += got.refused
        self.forgotten_pages += got.lost
        self.bytes_fetched += got.bytes_moved


class SharedStore(Protocol):
    name: str                       # "dir" | "ray", for the stats
    counters: ShareCounters

    def publish(self, key: bytes, payload: bytes) -> bool:
        """Store one page (False: it was there already, nothing written)."""

    def publish_many(self, keys: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        """Store pages (the publisher's batch); returns how many were new."""

    def published(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the store lists now (a cheap look, no page read)."""

    def fetch(self, keys: Sequence[bytes]) -> Fetched:
        """The leading pages of `keys`, each checked; stops at the first missing or bad."""

    def claim(self, keys: Sequence[bytes], owner: str, ttl_s: float) -> Claim:
        """Announce that `owner` is computing these pages (not yet published), for `ttl_s`
        seconds at most: the leading keys nobody else claims live are claimed (an expired
        claim is taken over); a key claimed by another live owner ends the run."""

    def release_claims(self, keys: Sequence[bytes], owner: str) -> None:
        """Drop `owner`'s claims on these keys (published, or it will not compute them)."""

    def close(self) -> None: ...


def parse_share(spec: str | None) -> tuple[str, str | None]:
    """`--kv-share`: "off" | "ray" | "dir:PATH" -> (kind, path); ValueError naming it."""
    if spec is None or spec == "off":
        return "off", None
    if spec == "ray":
        return "ray", None
    if spec.startswith("dir:") and len(spec) > 4:
        return "dir", spec[4:]
    raise ValueError(f"--kv-share must be off, ray or dir:PATH, got {spec!r}")


def share_arg(spec: str) -> str:
    """argparse type of `--kv-share`: the spec, checked."""
    import argparse

    try:
        parse_share(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def open_shared_store(spec: str | None, capacity_bytes: int, owner: str,
                      call_timeout_s: float = 5.0) -> SharedStore | None:
    """The store `--kv-share` names (None: off). `owner` names this replica in the Ray
    directory (a dead owner's pages are forgotten); `call_timeout_s` bounds each of its
    Ray calls (a slower one is a miss)."""
    kind, path = parse_share(spec)
    if kind == "dir":
        from .dir_store import DirSharedStore

        return DirSharedStore(path, capacity_bytes)
    if kind == "ray":
        from .ray_store import RaySharedStore

        return RaySharedStore(capacity_bytes, owner, call_timeout_s=call_timeout_s)
    return None
