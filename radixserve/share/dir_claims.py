"""DirClaims: "I am computing this page" as claim files beside the shared pages.

A replica that starts computing pages nobody has published claims them, so that another
replica missing the same prefix waits for the publication instead of computing it too
(the few-shot burst: every replica starts the same prefix at once). One file per page,
`<key>.claim`, created with O_EXCL: of several replicas claiming a page at once exactly one
creates it. The file holds its owner and deadline (`time.time()`; replicas on several hosts
need clocks in step to within the claim's length). A claim whose deadline passed (its owner
died, or was slower than it said) is taken over; two replicas taking over the same expired
claim at once may both compute the page, which costs a recompute, never a wrong page.

An owner claiming its own page again renews it (a new deadline, written to a temporary file
and renamed over the claim, so a reader sees the old deadline or the new one): a replica
whose prefill is still progressing keeps its claim (engine/peer_share.py), as the Ray
directory does. A renewal racing a takeover of the same expired claim can at worst leave
both computing the page.

Expired claims whose page nobody asks for again would stay: `sweep` removes them (the store
runs it when it opens and whenever it scans the directory to evict). It follows the
takeover's rule (a claim past its deadline is nobody's), so a sweep racing a takeover can
at worst remove the fresh claim: a peer then computes the page too, never a wrong page.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Sequence

from .store import Claim

__all__ = ["CLAIM_SUFFIX", "DirClaims"]

CLAIM_SUFFIX = ".claim"


class DirClaims:
    def __init__(self, root: Path):
        self.root = root

    def _path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}{CLAIM_SUFFIX}"

    def _create(self, path: Path, owner: str, deadline: float) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{deadline!r} {owner}")
        return True

    def _renew(self, path: Path, owner: str, deadline: float) -> None:
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
        try:
            tmp.write_text(f"{deadline!r} {owner}")
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)

    def _read(self, path: Path, ttl_s: float) -> tuple[str, float] | None:
        """(owner, deadline) of a claim file; None when it is gone. A file still being
        written (empty) counts as a fresh claim by nobody we know."""
        try:
            text = path.read_text()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        deadline, _, owner = text.partition(" ")
        try:
            return owner, float(deadline)
        except ValueError:
            return "", mtime + ttl_s

    def claim(self, keys: Sequence[bytes], owner: str, ttl_s: float) -> Claim:
        now = time.time()
        deadline = now + ttl_s
        for i, key in enumerate(keys):
            path = self._path(key)
            if self._create(path, owner, deadline):
                continue
            held = self._read(path, ttl_s)
            if held is None:                    # released meanwhile: ours, unless taken
                if self._create(path, owner, deadline):
                    continue
                held = self._read(path, ttl_s)
            if held is not None and held[0] == owner:
                self._renew(path, owner, deadline)      # ours already: a new deadline
                continue
            if held is not None and held[1] <= now:
                path.unlink(missing_ok=True)    # expired: taken over
                if self._create(path, owner, deadline):
                    continue
                held = self._read(path, ttl_s)
            until = held[1] if held is not None else deadline
            return Claim(i, until if i == 0 else None)
        return Claim(len(keys))

    def sweep(self, now: float | None = None) -> int:
        """Remove every claim file whose deadline has passed; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        for entry in os.scandir(self.root):
            if not entry.name.endswith(CLAIM_SUFFIX):
                continue
            held = self._read(Path(entry.path), 0.0)
            if held is not None and held[1] <= now:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
        return removed

    def release(self, keys: Sequence[bytes], owner: str) -> None:
        for key in keys:
            path = self._path(key)
            held = self._read(path, 0.0)
            if held is not None and held[0] == owner:
                path.unlink(missing_ok=True)
