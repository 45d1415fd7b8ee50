"""RaySharedStore: shared pages in Ray's object store, listed by one directory actor.

`--kv-share ray` (with `serve --replicas N`, or any Ray job). A publish `ray.put`s the
framed page (framing.py) once and registers its ObjectRef with the directory actor under
the page's entry key; a fetch asks the actor for the refs of the longest published run of
keys and `ray.get`s them, checking each page against its key.

Ownership and lifetime (Ray's rules, which this design follows rather than fights):
- The replica that `ray.put` a page *owns* its object. The directory actor holds the ref
  (inside a list, so it is passed as a ref), which keeps the object alive while the owner
  lives. When the owner dies, Ray loses the object: a later `ray.get` raises
  OwnerDiedError / ObjectLostError. Such a page is never read; the fetch stops there,
  tells the actor to forget the key (and every key of that owner), and the caller
  recomputes.
- The actor is bounded (`capacity_bytes`, least recently fetched first out); an evicted
  entry's ref is dropped, and Ray frees the object once nobody else holds it.
- The actor is named, detached and restarted by Ray when it dies (`max_restarts=-1`). A
  restarted actor is empty: pages published before are forgotten, replicas publish again
  as they compute. While it is down, look-ups find nothing (RayActorError or a timeout is
  a miss, never an error to the request).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Sequence

from .framing import frame
from .store import Claim, Fetched, ShareCounters

__all__ = ["ACTOR_NAME", "RaySharedStore", "ShareDirectory"]

ACTOR_NAME = "radixserve-kv-share"
ACTOR_NAMESPACE = "radixserve"
CALL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 60.0
RETRY_AFTER_S = 2.0     # after a failed call, look-ups miss at once for this long
CLAIMS_SWEPT_FROM = 4096    # claims in the table before expired ones are swept


class ShareDirectory:
    """The actor's state: entry key -> (ref, owner, bytes), least recently used first."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, tuple[list, str, int]] = OrderedDict()
        self.used_bytes = 0
        self.evicted = 0
        self.claims: dict[bytes, tuple[str, float]] = {}
        self._sweep_claims_at = CLAIMS_SWEPT_FROM

    def claim(self, keys: Sequence[bytes], owner: str, ttl_s: float
              ) -> tuple[int, float | None]:
        """SharedStore.claim, as (claimed, seconds the other owner's claim has left): the
        time left, not a deadline, since the caller's clock may differ from this one's."""
        now = time.time()
        if len(self.claims) >= self._sweep_claims_at:
            self.sweep_claims(now)
        for i, key in enumerate(keys):
            held = self.claims.get(key)
            if held is None or held[0] == owner or held[1] <= now:
                self.claims[key] = (owner, now + ttl_s)
                continue
            return i, (held[1] - now if i == 0 else None)
        return len(keys), None

    def sweep_claims(self, now: float) -> int:
        """Drop expired claims (a dead owner's are never released); run once the table
        has doubled since the last sweep, so its cost per claim stays constant."""
        expired = [k for k, (_, deadline) in self.claims.items() if deadline <= now]
        for key in expired:
            del self.claims[key]
        self._sweep_claims_at = max(CLAIMS_SWEPT_FROM, 2 * len(self.claims))
        return len(expired)

    def release_claims(self, keys: Sequence[bytes], owner: str) -> None:
        for key in keys:
            held = self.claims.get(key)
            if held is not None and held[0] == owner:
                del self.claims[key]

    def publish(self, key: bytes, boxed_ref: list, owner: str, nbytes: int) -> bool:
        """Register a page (False: one copy is there already, and it wins)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        self.entries[key] = (boxed_ref, owner, nbytes)
        self.used_bytes += nbytes
        while self.used_bytes > self.capacity_bytes and self.entries:
            _, (_, _, size) = self.entries.popitem(last=False)
            self.used_bytes -= size
            self.evicted += 1
        return True

    def publish_many(self, keys: Sequence[bytes], boxed_refs: Sequence[list], owner: str,
                     sizes: Sequence[int]) -> int:
        return sum(self.publish(k, r, owner, n) for k, r, n in zip(keys, boxed_refs, sizes))

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys not registered (a publisher puts only those)."""
        return [k for k in keys if k not in self.entries]

    def published(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.entries:
                break
            n += 1
        return n

    def lookup(self, keys: Sequence[bytes]) -> list[list]:
        """The boxed refs of the leading published keys (each refreshed)."""
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None:
                break
            self.entries.move_to_end(key)
            out.append(entry[0])
        return out

    def forget(self, key: bytes) -> int:
        """Forget a page whose object is gone, and every page of the same owner (its
        objects went with it). Returns the entries forgotten."""
        entry = self.entries.get(key)
        if entry is None:
            return 0
        owner = entry[1]
        gone = [k for k, (_, o, _) in self.entries.items() if o == owner]
        for k in gone:
            self.used_bytes -= self.entries.pop(k)[2]
        return len(gone)

    def forget_key(self, key: bytes) -> int:
        """Forget one page (its object failed its check)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return 0
        self.used_bytes -= entry[2]
        return 1

    def clear(self) -> int:
        """Forget every page (a benchmark between configurations)."""
        n = len(self.entries)
        self.entries.clear()
        self.claims.clear()
        self.used_bytes = 0
        return n

    def size(self) -> dict:
        return {"entries": len(self.entries), "used_bytes": self.used_bytes,
                "evicted": self.evicted}


def directory_actor(capacity_bytes: int):
    """The cluster's directory actor: created by the first replica, found by the others."""
    import ray

    actor = ray.remote(ShareDirectory).options(
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, get_if_exists=True,
        lifetime="detached", max_restarts=-1, num_cpus=0)
    return actor.remote(capacity_bytes)


def clear_directory() -> int:
    """Empty the cluster's directory actor, if there is one (pages forgotten)."""
    import ray

    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    except ValueError:
        return 0
    return ray.get(actor.clear.remote(), timeout=CALL_TIMEOUT_S)


class RaySharedStore:
    name = "ray"

    def __init__(self, capacity_bytes: int, owner: str, actor=None,
                 call_timeout_s: float = CALL_TIMEOUT_S):
        import ray

        self._ray = ray
        self.owner = owner
        self.call_timeout_s = call_timeout_s     # a slower actor call or get is a miss
        self.actor = actor if actor is not None else directory_actor(capacity_bytes)
        self.counters = ShareCounters()
        self._lock = threading.Lock()
        self._down_until = 0.0          # time.monotonic() before which calls are skipped
        try:                            # the actor's start (once per cluster) can be slow
            ray.get(self.actor.size.remote(), timeout=START_TIMEOUT_S)
        except ray.exceptions.RayError:
            self._down_until = time.monotonic() + RETRY_AFTER_S

    def _call(self, method, *args, default):
        """An actor call; while the actor is down or slow, `default` (a miss). After a
        failure, calls answer `default` at once for RETRY_AFTER_S: an admission never
        waits on a directory that is restarting more than once per interval."""
        ray = self._ray
        if time.monotonic() < self._down_until:
            return default
        try:
            return ray.get(getattr(self.actor, method).remote(*args),
                           timeout=self.call_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError):
            self._down_until = time.monotonic() + RETRY_AFTER_S
            return default

    def publish(self, key: bytes, payload: bytes) -> bool:
        if self._call("published", [key], default=0):
            with self._lock:
                self.counters.duplicate_pages += 1
            return False
        blob = frame(key, payload)
        ref = self._ray.put(blob)           # owned by this replica (see the module doc)
        added = self._call("publish", key, [ref], self.owner, len(blob), default=False)
        with self._lock:
            if added:
                self.counters.published_pages += 1
                self.counters.bytes_published += len(blob)
            else:
                self.counters.duplicate_pages += 1
        return bool(added)

    def publish_many(self, keys: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        """Two actor calls for the batch: which keys are missing, then their refs."""
        wanted = set(self._call("missing", list(keys), default=[]))
        todo = [(k, frame(k, p)) for k, p in zip(keys, payloads) if k in wanted]
        refs = [[self._ray.put(blob)] for _, blob in todo]   # owned here (module doc)
        added = self._call("publish_many", [k for k, _ in todo], refs, self.owner,
                           [len(b) for _, b in todo], default=0) if todo else 0
        with self._lock:
            self.counters.published_pages += added
            self.counters.bytes_published += sum(len(b) for _, b in todo) if added else 0
            self.counters.duplicate_pages += len(keys) - added
        return added

    def published(self, keys: Sequence[bytes]) -> int:
        return self._call("published", list(keys), default=0) if keys else 0

    def fetch(self, keys: Sequence[bytes]) -> Fetched:
        ray = self._ray
        got = Fetched()
        boxed = self._call("lookup", list(keys), default=[]) if keys else []
        for key, (ref,) in zip(keys, boxed):
            try:
                blob = ray.get(ref, timeout=self.call_timeout_s)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
                    ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
                got.lost += self._call("forget", key, default=0) or 1
                break
            if not got.add(key, blob):
                self._call("forget_key", key, default=0)
                break
        with self._lock:
            self.counters.add_fetch(got)
        return got

    def claim(self, keys: Sequence[bytes], owner: str, ttl_s: float) -> Claim:
        """(With the actor down: nothing claimed and nothing held, so the caller computes.)"""
        if not keys:
            return Claim()
        claimed, left = self._call("claim", list(keys), owner, ttl_s, default=(0, None))
        return Claim(claimed, None if left is None else time.time() + left)

    def release_claims(self, keys: Sequence[bytes], owner: str) -> None:
        if keys:
            self._call("release_claims", list(keys), owner, default=None)

    def close(self) -> None:
        """The actor stays (detached, shared by the cluster); this replica's objects go
        when its process ends, and the directory forgets them on first use."""
