"""Stored responses (`POST /v1/responses` with `store`): a conversation kept as chat items
and as the exact token ids the engine ran (prompt plus generated reply), so a follow-up
extends those ids instead of re-rendering the history.

Bounded: at most `max_responses` responses and `max_tokens` stored token ids, the least
recently used dropped first, and each lapses `ttl_s` after its last use; a dropped or lapsed
id answers 404 like one that never existed. Scoped: an id is found only by the key that
created it. With a directory (`--kv-disk-dir`), each response is one JSON file written
atomically, so the conversations survive a restart together with the saved KV.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import msgspec

from radixserve.server.errors import ApiError
from radixserve.storage.atomic_files import write_atomic

log = logging.getLogger(__name__)

STORE_SUBDIR = "responses"


class StoredResponse(msgspec.Struct, kw_only=True):
    id: str
    owner: str | None               # who may read it: a digest of the creating key
    namespace: str | None           # the cache namespace its tokens live in
    created_at: int
    last_used: float
    messages: list[dict]            # the conversation sent to the template, reply excluded
    reply: str                      # the generated text
    token_ids: list[int]            # prompt + generated ids, exactly as the engine ran them
    body: dict                      # the response object as returned
    pin_id: str | None = None       # this server run's TimedPins id (not meaningful on disk)
    model: str = ""                 # the model identity its ids belong to (conversations.py)


def not_found(response_id: str, param: str = "response_id") -> ApiError:
    return ApiError(404, f"no stored response has the id {response_id[:100]!r} (unknown, "
                         f"deleted, expired, or created with another key)",
                    type="not_found_error", param=param, code="response_not_found")


class ResponseStore:
    def __init__(self, max_responses: int, max_tokens: int, ttl_s: float,
                 directory: Path | None = None, clock: Callable[[], float] = time.time):
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self.directory = directory
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()    # LRU first
        self.stored_tokens = 0
        self.dropped = 0            # responses dropped for the budget or their TTL
        if directory is not None and directory.is_dir():
            self._load()

    def __len__(self) -> int:
        return len(self._items)

    # ---- reading --------------------------------------------------------------------
    def get(self, response_id: str, owner: str | None, param: str = "response_id",
            touch: bool = True) -> StoredResponse:
        """The response, or 404 (unknown, lapsed, or another key's)."""
        self.expire()
        item = self._items.get(response_id)
        if item is None or item.owner != owner:
            raise not_found(response_id, param)
        if touch:
            item.last_used = self.clock()
            self._items.move_to_end(response_id)
        return item

    # ---- writing --------------------------------------------------------------------
    def put(self, item: StoredResponse) -> list[StoredResponse]:
        """Store `item`; returns the responses dropped to stay within the budgets (their
        pins are the caller's to release)."""
        item.last_used = self.clock()
        self._items[item.id] = item
        self.stored_tokens += len(item.token_ids)
        self._write(item)
        dropped = self.expire()
        while len(self._items) > 1 and (len(self._items) > self.max_responses
                                        or self.stored_tokens > self.max_tokens):
            dropped.append(self._drop(next(iter(self._items))))
        return dropped

    def delete(self, response_id: str, owner: str | None) -> StoredResponse:
        self.get(response_id, owner, touch=False)
        return self._drop(response_id, counted=False)

    def expire(self) -> list[StoredResponse]:
        """Drop the responses unused for `ttl_s`."""
        limit = self.clock() - self.ttl_s
        lapsed = [k for k, v in self._items.items() if v.last_used <= limit]
        return [self._drop(k) for k in lapsed]

    def _drop(self, response_id: str, counted: bool = True) -> StoredResponse:
        item = self._items.pop(response_id)
        self.stored_tokens -= len(item.token_ids)
        self.dropped += counted
        if self.directory is not None:
            self._path(response_id).unlink(missing_ok=True)
        return item

    # ---- on disk --------------------------------------------------------------------
    def _path(self, response_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{response_id}.json"

    def _write(self, item: StoredResponse) -> None:
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(self._path(item.id), [msgspec.json.encode(item)], sync_dir=False)
        except OSError as exc:
            log.warning("could not save response %s: %s", item.id, exc)

    def _load(self) -> None:
        assert self.directory is not None
        loaded = []
        for path in self.directory.glob("resp_*.json"):
            try:
                item = msgspec.json.decode(path.read_bytes(), type=StoredResponse)
            except (OSError, msgspec.DecodeError) as exc:
                log.warning("skipping the unreadable stored response %s: %s", path.name, exc)
                continue
            item.pin_id = None
            loaded.append(item)
        for item in sorted(loaded, key=lambda r: r.last_used):
            self._items[item.id] = item
            self.stored_tokens += len(item.token_ids)
        self.expire()
        if loaded:
            log.info("restored %d stored responses from %s", len(self._items), self.directory)
