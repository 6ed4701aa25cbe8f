"""``core/http1.py`` against real sockets: a server written per test, byte by byte, so each
case (kept-alive connections, a connection closed under a request, a body cut short, one
that ends with its connection, bad HTTP) happens exactly as the test says. One race that
real sockets would show only by chance (a caller leaving just as its whole answer came) is
played over a transport that keeps what is written."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme
import uvloop

from core.http1 import Http1Client, HttpConnectionError, Origin, _Connection, worker_url

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Served"], Awaitable[None]]


@dataclass
class Served:
    base_url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    eof_seen: asyncio.Event = field(default_factory=asyncio.Event)


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's head and body (by its Content-Length); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


def answer(body: bytes, *, status: int = 200, close: bool = False) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n" % (status, len(body), connection) + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@asynccontextmanager
async def serve(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[Served]:
    """A server on a free port (HTTPS with ``tls``); ``handler`` gets each connection
    (``served.connections`` counts them, this one included)."""
    served = Served("")

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.connections += 1
        try:
            await handler(reader, writer, served)
        finally:
            writer.close()

    server = await asyncio.start_server(connected, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls else "http"
    served.base_url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield served
    finally:
        server.close()


def answering(response: Callable[[int], bytes]) -> Handler:
    """Answers each request on a connection with ``response(i)`` (i counts every request)."""

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: Served
    ) -> None:
        while (request := await read_request(reader)) is not None:
            served.requests.append(request)
            writer.write(response(len(served.requests) - 1))
        served.eof_seen.set()

    return handler


def replying(data: bytes, *, then_close: bool = False) -> Handler:
    """Reads one request and writes ``data``; then closes the connection (``then_close``) or
    waits for the client to."""

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: Served
    ) -> None:
        await read_request(reader)
        writer.write(data)
        await writer.drain()
        if not then_close:
            await reader.read()

    return handler


@asynccontextmanager
async def client(idle_s: float = 4.0) -> AsyncIterator[Http1Client]:
    http = Http1Client(connect_timeout_s=2, idle_s=idle_s)
    try:
        yield http
    finally:
        await http.aclose()


async def test_requests_share_one_kept_alive_connection_and_carry_their_head() -> None:
    async with (
        serve(answering(lambda i: answer(b'{"n": %d}' % i))) as served,
        client() as http,
    ):
        for i in range(3):
            response = await http.post(served.base_url, "/v1/x", b'{"a": 1}', [("X-Id", f"r{i}")])
            assert response.status == 200
            assert await response.read() == b'{"n": %d}' % i
        assert served.connections == 1
        head, _, body = served.requests[2].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/x HTTP/1.1"
        port = served.base_url.rsplit(":", 1)[1].encode()
        assert set(lines[1:]) == {
            b"Host: 127.0.0.1:" + port,
            b"X-Id: r2",
            b"Content-Type: application/json",
            b"Content-Length: 8",
        }
        assert body == b'{"a": 1}'


async def test_a_chunked_body_is_read_as_it_arrives() -> None:
    go_on = asyncio.Event()

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: Served
    ) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunked(b"data: 1\n\n"))
        await go_on.wait()
        writer.write(chunked(b"data: 2\n\n") + b"0\r\n\r\n")
        await reader.read()

    async with serve(handler) as served, client() as http:
        response = await http.post(served.base_url, "/", b"{}", ())
        assert await response.read_some() == b"data: 1\n\n"
        go_on.set()
        assert await response.read() == b"data: 2\n\n"
        assert response.bytes_received == 18


async def test_closing_a_response_before_its_end_drops_its_connection() -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: Served
    ) -> None:
        while (request := await read_request(reader)) is not None:
            served.requests.append(request)
            writer.write(CHUNKED_HEAD + chunked(b"data: 1\n\n"))  # and never an end
        served.eof_seen.set()

    async with serve(handler) as served, client() as http:
        response = await http.post(served.base_url, "/", b"{}", ())
        assert await response.read_some() == b"data: 1\n\n"
        response.close()
        await asyncio.wait_for(served.eof_seen.wait(), 2)  # the server sees its client leave
        second = await http.post(served.base_url, "/", b"{}", ())
        second.close()
        assert served.connections == 2


async def test_a_cancelled_post_drops_its_connection() -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: Served
    ) -> None:
        await read_request(reader)  # never answered
        await reader.read()
        served.eof_seen.set()

    async with serve(handler) as served, client() as http:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(http.post(served.base_url, "/", b"{}", ()), 0.2)
        await asyncio.wait_for(served.eof_seen.wait(), 2)


async def test_a_kept_alive_connection_closed_under_a_request_is_tried_once_more() -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: Served
    ) -> None:
        if served.connections == 1:
            await read_request(reader)
            writer.write(answer(b"first"))
            await read_request(reader)  # the next request on it: closed without an answer
            return
        await read_request(reader)
        writer.write(answer(b"second"))
        await reader.read()

    async with serve(handler) as served, client() as http:
        assert await (await http.post(served.base_url, "/", b"{}", ())).read() == b"first"
        assert await (await http.post(served.base_url, "/", b"{}", ())).read() == b"second"
        assert served.connections == 2


async def test_a_new_connection_closed_without_an_answer_fails() -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: Served
    ) -> None:
        await read_request(reader)

    async with serve(handler) as served, client() as http:
        with pytest.raises(HttpConnectionError, match="closed the connection"):
            await http.post(served.base_url, "/", b"{}", ())
        assert served.connections == 1  # not tried again


async def test_a_body_cut_short_fails_its_reader() -> None:
    async with (
        serve(replying(CHUNKED_HEAD + chunked(b"data: 1\n\n"), then_close=True)) as served,
        client() as http,
    ):
        response = await http.post(served.base_url, "/", b"{}", ())
        assert await response.read_some() == b"data: 1\n\n"
        with pytest.raises(HttpConnectionError):
            await response.read_some()


async def test_a_body_that_ends_with_its_connection_is_whole() -> None:
    async with (
        serve(
            replying(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it", then_close=True)
        ) as served,
        client() as http,
    ):
        response = await http.post(served.base_url, "/", b"{}", ())
        assert await response.read() == b"all of it"


async def test_connection_close_and_idle_connections_are_not_used_again() -> None:
    closing = {0}  # the first answer says Connection: close
    handler = answering(lambda i: answer(b"ok", close=i in closing))
    async with serve(handler) as served, client(idle_s=0.2) as http:
        for _ in range(2):
            assert await (await http.post(served.base_url, "/", b"{}", ())).read() == b"ok"
        assert served.connections == 2  # the first was closed
        await asyncio.sleep(0.3)
        assert await (await http.post(served.base_url, "/", b"{}", ())).read() == b"ok"
        assert served.connections == 3  # the second sat idle too long


async def test_a_connection_idle_too_long_is_closed_when_another_comes_back() -> None:
    left: list[int] = []  # the connections whose client closed them, by number

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: Served
    ) -> None:
        number = served.connections
        while await read_request(reader) is not None:
            writer.write(answer(b"ok"))
        left.append(number)

    async with serve(handler) as served, client(idle_s=0.5) as http:
        first, second = await asyncio.gather(
            *(http.post(served.base_url, "/", b"{}", ()) for _ in range(2))
        )
        await first.read()
        await second.read()  # two idle connections
        await asyncio.sleep(0.3)
        assert await (await http.post(served.base_url, "/", b"{}", ())).read() == b"ok"
        await asyncio.sleep(0.35)  # one idle for 0.65 s, the other (used again) for 0.35 s
        assert await (await http.post(served.base_url, "/", b"{}", ())).read() == b"ok"
        await asyncio.sleep(0.1)
        assert len(left) == 1  # the older one, closed when the other came back
        assert served.connections == 2


async def test_bad_http_fails_the_request() -> None:
    async with serve(replying(b"NOT HTTP AT ALL\r\n\r\n")) as served, client() as http:
        with pytest.raises(HttpConnectionError, match="not valid HTTP"):
            await http.post(served.base_url, "/", b"{}", ())


async def test_fail_ends_a_waiting_read_after_what_arrived() -> None:
    async with serve(replying(CHUNKED_HEAD + chunked(b"early"))) as served, client() as http:
        response = await http.post(served.base_url, "/", b"{}", ())
        await asyncio.sleep(0.05)  # "early" has arrived
        response.fail(LookupError("watchdog"))
        assert await response.read_some() == b"early"
        with pytest.raises(LookupError, match="watchdog"):
            await response.read_some()
        response.close()


async def test_a_large_body_past_the_read_pause_arrives_whole() -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: reading pauses at 256 KiB unread and resumes
    async with serve(answering(lambda _: answer(body))) as served, client() as http:
        response = await http.post(served.base_url, "/", b"{}", ())
        await asyncio.sleep(0.1)
        assert response.bytes_received < len(body)  # paused, not buffering it all
        assert await response.read() == body


async def test_refused_connections_and_bad_input_say_what_is_wrong() -> None:
    async with serve(answering(lambda _: b"")) as served:
        url = served.base_url
    async with client() as http:
        with pytest.raises(HttpConnectionError, match="cannot connect"):
            await http.post(url, "/", b"{}", ())
        with pytest.raises(ValueError, match="line break"):
            await http.post(url, "/", b"{}", [("X-Id", "a\r\nX-Evil: 1")])
    with pytest.raises(ValueError, match="http"):
        Origin.of("ftp://example.com")
    assert Origin.of("https://[::1]/").host_header() == "[::1]:443"


async def test_a_base_url_with_a_path_prefix_sends_every_path_under_it() -> None:
    # A worker behind a proxy that routes by path (an ingress at /vllm/prefill-0).
    async with serve(answering(lambda _: answer(b"ok"))) as served, client() as http:
        for base_url in (f"{served.base_url}/vllm/prefill-0", served.base_url):
            response = await http.post(base_url, "/v1/completions", b"{}", ())
            assert await response.read() == b"ok"
        assert served.connections == 1  # one origin, one kept-alive connection
    request_lines = [request.split(b"\r\n", 1)[0] for request in served.requests]
    assert request_lines == [
        b"POST /vllm/prefill-0/v1/completions HTTP/1.1",
        b"POST /v1/completions HTTP/1.1",
    ]


@pytest.mark.parametrize(
    ("value", "url"),
    [
        (" http://decode-0:8000/ ", "http://decode-0:8000"),
        ("https://gpu.example.com", "https://gpu.example.com"),
        ("http://[::1]:8100/vllm/a/", "http://[::1]:8100/vllm/a"),
    ],
)
def test_a_worker_url_is_trimmed_as_the_gateway_appends_paths(value: str, url: str) -> None:
    assert worker_url(value) == url


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("decode-0:8000", "http\\(s\\)://host"),  # no scheme: urlsplit reads a scheme "decode-0"
        ("localhost:8000", "http\\(s\\)://host"),
        ("ftp://decode-0", "http\\(s\\)://host"),
        ("http://", "http\\(s\\)://host"),
        ("http://decode-0:80x0", "Port could not be cast"),
        ("http://decode-0:99999", "Port out of range"),
        ("http://decode-0:8000/?key=1", "without a query"),
        ("http://user:pw@decode-0:8000", "without a query, fragment or user"),
    ],
)
def test_a_worker_url_the_client_could_not_call_is_refused_saying_why(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        worker_url(value)


def test_a_round_trip_on_uvloop_the_gateways_loop() -> None:
    # The gateway runs on uvloop (gateway/cli/serve.py), whose transports are its own classes.
    async def round_trip() -> tuple[bytes, bytes, int]:
        async with serve(answering(lambda i: answer(b"%d" % i))) as served, client() as http:
            first = await (await http.post(served.base_url, "/", b"{}", ())).read()
            second = await (await http.post(served.base_url, "/", b"{}", ())).read()
            return first, second, served.connections

    assert uvloop.run(round_trip()) == (b"0", b"1", 1)


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_https_workers_are_checked_against_the_trusted_authorities(
    run: Callable[[Awaitable[tuple[bytes, bytes]]], tuple[bytes, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``https://`` worker's certificate is verified against the system's authorities;
    ``SSL_CERT_FILE`` names others (a private CA's), as OpenSSL reads it."""
    authority = trustme.CA()
    authority.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_side)

    async def round_trips() -> tuple[bytes, bytes]:
        async with serve(answering(lambda i: answer(b"%d" % i)), tls=server_side) as served:
            async with client() as http:
                with pytest.raises(HttpConnectionError, match="certificate verify failed"):
                    await http.post(served.base_url, "/", b"{}", ())
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
            async with client() as http:
                first = await (await http.post(served.base_url, "/", b"{}", ())).read()
                second = await (await http.post(served.base_url, "/", b"{}", ())).read()
            assert served.connections == 1  # kept alive over TLS too
            return first, second

    assert run(round_trips()) == (b"0", b"1")


class _Wire(asyncio.Transport):
    """A transport that keeps what is written, for one exact interleaving the loop decides."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def writelines(self, data: Iterable[bytes]) -> None:  # type: ignore[override]
        self.written.extend(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


async def test_a_caller_leaving_as_the_answer_came_keeps_the_pooled_connection() -> None:
    http = Http1Client(connect_timeout_s=2)
    origin = Origin.of("http://127.0.0.1:9")
    connection = _Connection(http, origin)
    wire = _Wire()
    connection.connection_made(wire)
    exchange = asyncio.ensure_future(http._exchange(connection, (b"POST / HTTP/1.1\r\n\r\n", b"")))
    await asyncio.sleep(0)  # the request is written; the caller waits for the head
    connection.data_received(answer(b"ok"))  # the whole answer: the connection is pooled
    exchange.cancel()  # and the caller leaves before it ran again
    await asyncio.wait([exchange])
    assert not wire.closed
    assert http._reused(origin) is connection
