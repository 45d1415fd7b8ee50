"""OpenAI-style errors: one exception type carrying status, type, param and code.

Transport-free (no aiohttp) so the offline batch job reports errors in exactly the shape
the HTTP server does. `api_error_from` maps engine exceptions to their documented status.
"""

from __future__ import annotations

import re

import msgspec

from radixserve.engine.errors import (CacheBusy, EngineStopped, EngineUnhealthy, InvalidRequest,
                                      NoDiskStore, PinConflict, PinLimitExceeded, QueueFull,
                                      DiskUnwritable,
                                      Unsupported, UnknownPin)

_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class ApiError(Exception):
    """An error answered with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, int] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}        # figures beside OpenAI's four fields (409 pin limit)

    def body(self) -> ErrorBody | dict:
        info = ErrorInfo(self.message, self.type, self.param, self.code)
        if not self.extra:
            return ErrorBody(info)
        return {"error": {**msgspec.structs.asdict(info), **self.extra}}


def bad_request(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    """400 (OpenAI's status for any request it cannot honour, so its client raises
    BadRequestError): a valid OpenAI request using a feature this server does not implement."""
    return ApiError(400, message, param=param, code="unsupported_feature")


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """Malformed JSON and schema violations -> 400, with the offending field in `param`."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(None, f"request body is not valid JSON: {text[:300]}", "invalid_json")
    path = ""
    match = _AT_PATH.search(text)
    if match:
        path = match.group("path")
    missing = _MISSING.match(text)
    if missing:
        path = f"{path}.{missing.group('field')}"
    param = path.lstrip(".") or None
    return bad_request(param and param[:300], text[:500],
                       "invalid_value" if not missing else "missing_field")


def api_error_from(exc: BaseException) -> ApiError:
    """The documented status for an engine exception; 500 for anything unexpected."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return bad_request(exc.param, exc.message, exc.code)
    if isinstance(exc, QueueFull):
        return ApiError(503, f"server overloaded: {exc or 'the request queue is full'}; retry later",
                        type="overloaded_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineUnhealthy):
        return ApiError(503, f"the engine stopped after an internal error ({str(exc)[:300]}); "
                             f"see /health", type="service_unavailable", code="engine_unhealthy")
    if isinstance(exc, EngineStopped):
        return ApiError(503, "the server is shutting down and accepts no new requests",
                        type="service_unavailable", code="engine_stopped")
    if isinstance(exc, CacheBusy):
        return ApiError(409, f"cannot flush the cache now: {exc}",
                        type="conflict_error", code="cache_busy")
    if isinstance(exc, DiskUnwritable):
        full = exc.kind == "no_space"
        return ApiError(507 if full else 503, str(exc), type="service_unavailable",
                        code="kv_disk_full" if full else "kv_disk_unwritable",
                        headers=None if full else {"Retry-After": "1"})
    if isinstance(exc, NoDiskStore):
        return ApiError(409, str(exc), type="conflict_error", code="no_disk_store")
    if isinstance(exc, Unsupported):
        return ApiError(409, str(exc), type="conflict_error", code="unsupported")
    if isinstance(exc, PinLimitExceeded):
        return ApiError(409, str(exc), type="conflict_error", code=exc.code,
                        extra={"requested_tokens": exc.requested, "pinned_tokens": exc.pinned,
                               "max_pinned_tokens": exc.limit})
    if isinstance(exc, PinConflict):
        return ApiError(409, str(exc), type="conflict_error", code=exc.code)
    if isinstance(exc, UnknownPin):
        return ApiError(404, str(exc), type="not_found_error", param="pin_id", code="pin_not_found")
    if isinstance(exc, msgspec.DecodeError):
        return from_decode_error(exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                    type="internal_error", code="internal_error")
