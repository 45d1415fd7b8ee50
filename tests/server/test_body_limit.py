"""The request body limit (issue 39): `--max-body-bytes auto` derives it from the context; a
body over it gets 413 by its declared length before a byte of it is sent, or as soon as a
chunked body passes it; the 413 names the limit and the flag, the connection is closed
without reading the rest, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import select
import socket
from unittest import mock
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import make_mocked_request

from radixserve.cli import build_parser_for
from radixserve.server.app import error_middleware
from radixserve.server.body import body_too_large
from radixserve.server.body_limit import BodyLimit, parse_max_body_bytes
from radixserve.server.errors import ApiError
from radixserve.server.state import ServerConfig
from tests.server import http
from tests.server.fake_engine import FakeEngine
from tests.server.hostile import read_until_closed
from tests.server.live import LiveServer

CONTEXT = 512
AUTO_LIMIT = (1 << 20) + 64 * CONTEXT


def test_auto_limit_follows_the_context_and_a_size_replaces_it():
    assert BodyLimit.resolve(None, CONTEXT).bytes == AUTO_LIMIT
    assert BodyLimit.resolve(None, 131072).bytes == 9 << 20
    assert BodyLimit.resolve(4096, CONTEXT) == BodyLimit(4096, "set by --max-body-bytes")
    assert parse_max_body_bytes("auto") is None and parse_max_body_bytes("8MiB") == 8 << 20
    assert build_parser_for(["serve"]).parse_args(["serve"]).max_body_bytes is None
    with pytest.raises(ValueError, match="not a memory size"):
        parse_max_body_bytes("lots")


@pytest.fixture(scope="module")
def server():
    with LiveServer(FakeEngine(max_model_len=CONTEXT), ServerConfig(port=0)) as srv:
        yield srv


def exchange(url: str, head: bytes, chunks=()) -> tuple[bytes, int]:
    """Send `head`, then each chunk unless the server has answered: (the reply, body bytes
    sent). Reads until the server closes the connection."""
    parts = urlsplit(url)
    sent = 0
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                if select.select([sock], [], [], 0)[0]:
                    break                       # answered: stop sending, as curl does
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass                                # closed on us: the reply is still readable
        return read_until_closed(sock), sent


def post_head(length: int | None) -> bytes:
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()


def assert_refused(reply: bytes, limit: int) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), reply[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"
    assert f"limit of {limit} bytes" in error["message"]
    assert "--max-body-bytes auto" in error["message"]


def still_serving(server) -> None:
    r = http.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 200
    server.check_invariants()


def test_declared_length_over_the_limit_is_refused_before_a_byte_is_sent(server):
    reply, sent = exchange(server.url, post_head(AUTO_LIMIT + 1))
    assert sent == 0                   # the reply came (and the connection closed) unasked
    assert_refused(reply, AUTO_LIMIT)
    reply, _ = exchange(server.url, post_head(AUTO_LIMIT + 1), [b"x" * 65536] * 100)
    assert_refused(reply, AUTO_LIMIT)  # the rest of a 6.5 MB body was never waited for
    still_serving(server)


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    def chunked(total: int, piece: int = 65536):
        for _ in range(total // piece):
            yield b"%x\r\n%s\r\n" % (piece, b" " * piece)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    fits = [b"%x\r\n%s\r\n" % (len(body), body), b"0\r\n\r\n"]
    reply, _ = exchange(server.url, post_head(None)[:-2] + b"Connection: close\r\n\r\n", fits)
    assert reply.startswith(b"HTTP/1.1 200 ")             # chunks under the limit are read
    # never ended (no last chunk): only a refusal as it passes the limit answers it (a 408
    # after --body-timeout-s otherwise)
    reply, sent = exchange(server.url, post_head(None), chunked(4 * AUTO_LIMIT))
    assert_refused(reply, AUTO_LIMIT)
    assert sent > AUTO_LIMIT
    still_serving(server)


def test_a_413_closes_the_connection_without_reading_the_rest():
    """aiohttp's lingering close would read and drop the rest of the body; the 413 is written,
    then the connection closed at once (the protocol's force_close, which stops reading)."""
    protocol = mock.Mock()

    async def refuse(request):
        raise body_too_large(BodyLimit.resolve(None, CONTEXT))

    async def bad(request):
        raise ApiError(400, "bad")

    async def run(handler):
        request = make_mocked_request("POST", "/v1/completions", protocol=protocol)
        return await error_middleware(request, handler)

    response = asyncio.run(run(bad))
    assert response.status == 400 and not protocol.force_close.called
    response = asyncio.run(run(refuse))
    assert response.status == 413 and response.prepared and protocol.force_close.called


def expect_head(length: int, expect: str = "100-continue") -> bytes:
    return post_head(length)[:-2] + f"Expect: {expect}\r\nConnection: close\r\n\r\n".encode()


def test_expect_100_continue_is_answered_only_when_the_body_fits(server):
    """curl and many HTTP clients send `Expect: 100-continue` for big bodies and wait for the
    interim reply: one over the limit is refused before "100 Continue" (so nothing is
    sent), one within it gets "100 Continue" and then its answer."""
    reply, sent = exchange(server.url, expect_head(AUTO_LIMIT + 1))
    assert b"100 Continue" not in reply and sent == 0
    assert_refused(reply, AUTO_LIMIT)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(expect_head(len(body)))
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += sock.recv(1)            # the interim reply comes before any body
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200 ")
    reply, _ = exchange(server.url, expect_head(len(body), "something-else"), [body])
    assert reply.startswith(b"HTTP/1.1 417 ")
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "expectation_failed"
    still_serving(server)


def test_every_post_route_checks_the_length_before_continuing(server):
    from radixserve.server.app import build_app
    paths = sorted({route.resource.canonical for route in build_app(server.state).router.routes()
                    if route.method == "POST"})
    assert len(paths) >= 8
    for path in paths:
        head = expect_head(AUTO_LIMIT + 1).replace(b"/v1/completions", path.encode(), 1)
        reply, sent = exchange(server.url, head)
        assert sent == 0 and b"100 Continue" not in reply, path
        assert_refused(reply, AUTO_LIMIT)
    still_serving(server)
