"""Errors the engine raises to its callers (the server maps each to an HTTP status)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine reports to a caller."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine cannot run as given (HTTP 400). `param` names the field;
    `code` is the OpenAI error code, when there is a more precise one than the status."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


class QueueFull(EngineError):
    """More requests are waiting than the configured queue length (HTTP 503)."""


class CacheBusy(EngineError):
    """The cache cannot be flushed while requests hold pages (HTTP 409)."""


class NoDiskStore(EngineError):
    """A disk operation (POST /cache/save) on an engine without --kv-disk-dir (HTTP 409)."""


class DiskUnwritable(EngineError):
    """A save (POST /cache/save) the disk refused: full (HTTP 507) or read-only, failing
    (HTTP 503). Counted as a disk fault; the cache in memory and serving are unaffected."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind                # storage/disk_faults.py's fault kind


class Unsupported(EngineError):
    """An operation this engine's setup does not offer (HTTP 409), e.g. the tree view with
    --replicas, where there is no one tree."""


class EngineStopped(EngineError):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""


class EngineUnhealthy(EngineStopped):
    """The engine stopped itself after an internal failure (HTTP 503); `Engine.error` says
    why, and `Engine.healthy` is False until the process restarts."""


class PinConflict(EngineError):
    """A pin the engine cannot take now (HTTP 409): over `--max-pinned-tokens`, pinning
    off, or not available here. `code` is the OpenAI-style error code."""

    def __init__(self, message: str, code: str = "pin_conflict"):
        super().__init__(message)
        self.code = code


class PinLimitExceeded(PinConflict):
    """Pinning `requested` more tokens would pass `--max-pinned-tokens` (`limit`)."""

    def __init__(self, requested: int, pinned: int, limit: int):
        if limit == 0:
            why = "pinning is off (--max-pinned-tokens 0)"
        elif requested > limit:
            why = f"the prefix alone is longer than --max-pinned-tokens ({limit} tokens)"
        else:
            why = (f"{pinned} tokens are pinned (or being pinned) of at most {limit} "
                   f"(--max-pinned-tokens); unpin a prefix first (DELETE /cache/pin/{{id}})")
        super().__init__(f"cannot pin {requested} tokens: {why}", code="pin_limit_exceeded")
        self.requested = requested
        self.pinned = pinned
        self.limit = limit


class UnknownPin(EngineError, LookupError):
    """No pinned prefix has this id (HTTP 404)."""
