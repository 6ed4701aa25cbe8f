"""Each limit on what a request may send, at its edge, with the clear error it promises
(docs/WIRE.md, "Limits").

All run against ``tandem up`` (``running``: its HTTP server and settings as in production,
with the small limits of ``RUNNING_LIMITS``); the body and head limits over raw sockets, so a
test can send a body byte by byte, a header that never ends, or headers and nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from gateway.serving.schemas import ChatCompletionRequest
from tests.fuzz.checks import assert_openai_error
from tests.fuzz.fuzzing import RUNNING_LIMITS
from tests.fuzz.gateways import MODEL, Gateway

MAX_BODY = int(RUNNING_LIMITS["TANDEM_MAX_BODY_BYTES"])
MAX_HEADERS = int(RUNNING_LIMITS["TANDEM_MAX_HEADER_BYTES"])
BODY_TIMEOUT_S = float(RUNNING_LIMITS["TANDEM_BODY_TIMEOUT_S"])
HEAD_TIMEOUT_S = float(RUNNING_LIMITS["TANDEM_HEADER_TIMEOUT_S"])
HELLO = [{"role": "user", "content": "hello"}]


class RawAnswer:
    """An HTTP/1.1 answer read off a socket until the server closed it."""

    def __init__(self, raw: bytes, elapsed_s: float) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines[0] else 0
        self.headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:])
        }
        self.elapsed_s = elapsed_s

    def error(self) -> dict[str, Any]:
        """The OpenAI error body, checked for its shape."""
        assert self.headers.get("content-type") == "application/json", self.headers
        body = orjson.loads(self.body)
        assert_openai_error(body)
        return dict(body["error"])


async def send_raw(gateway: Gateway, *parts: bytes | float, wait_s: float = 10.0) -> RawAnswer:
    """Send ``parts`` (bytes, or a float: seconds to pause) on a new connection, reading all the
    while; the answer is what came until the server closed the connection (which every refusal
    here must do)."""
    assert gateway.base_url is not None
    host, port = gateway.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()

    async def read_to_the_end() -> bytes:
        received = bytearray()
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received += chunk
        return bytes(received)

    reading = asyncio.create_task(read_to_the_end())
    try:
        for part in parts:
            if reading.done():
                break  # answered and closed: the rest is not read
            if isinstance(part, float):
                await asyncio.sleep(part)
                continue
            with contextlib.suppress(ConnectionError):
                writer.write(part)
                await writer.drain()
        raw = await asyncio.wait_for(reading, wait_s)
    finally:
        writer.close()
    return RawAnswer(raw, time.monotonic() - started)


def head(gateway: Gateway, path: str = "/v1/chat/completions", **headers: str | int) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: gateway",
        f"Authorization: Bearer {gateway.tenant_key}",
    ]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chat_body(size: int | None = None, **fields: Any) -> bytes:
    """A chat request, padded with whitespace to exactly ``size`` bytes when given."""
    body = orjson.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields})
    if size is not None:
        assert len(body) <= size
        body += b" " * (size - len(body))
    return body


# The body: its size and the time it takes, before any route or admission.


async def test_a_body_declared_over_the_limit_is_413_before_a_byte_of_it_is_read(
    running: Gateway,
) -> None:
    answer = await send_raw(running, head(running, content_length=MAX_BODY + 1))
    assert answer.status == 413
    assert answer.error()["code"] == "body_too_large"
    assert answer.headers["connection"] == "close"
    assert answer.elapsed_s < BODY_TIMEOUT_S, "it waited for a body it refuses anyway"


async def test_a_chunked_body_is_413_once_it_streams_past_the_limit(running: Gateway) -> None:
    chunk = b"x" * 4096
    parts: list[bytes | float] = [head(running, transfer_encoding="chunked")]
    parts += [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (MAX_BODY // len(chunk) + 1)
    answer = await send_raw(running, *parts)
    assert answer.status == 413
    assert answer.error()["code"] == "body_too_large"


async def test_a_body_at_the_limit_is_served(running: Gateway) -> None:
    body = chat_body(size=MAX_BODY)
    async with httpx.AsyncClient(base_url=str(running.base_url), timeout=10) as http:
        answer = await http.post(
            "/v1/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {running.tenant_key}"},
        )
    assert answer.status_code == 200, answer.text


async def test_a_body_sent_byte_by_byte_is_cut_off_and_holds_no_admission_capacity(
    running: Gateway,
) -> None:
    async with httpx.AsyncClient(
        base_url=str(running.base_url),
        timeout=10,
        headers={"Authorization": f"Bearer {running.admin_key}"},
    ) as admin:
        created = await admin.post("/admin/v1/tenants", json={"name": "slow", "max_concurrent": 1})
        assert created.status_code == 201, created.text
        key = (await admin.post("/admin/v1/tenants/slow/keys", json={})).json()["key"]
        body = chat_body()
        slow_head = head(running, content_length=len(body)).replace(
            running.tenant_key.encode(), key.encode()
        )
        # The body trickles in and never completes, past the body timeout.
        trickle: list[bytes | float] = [slow_head]
        for byte in body[:8]:
            trickle += [bytes([byte]), BODY_TIMEOUT_S / 8]
        slow = asyncio.create_task(send_raw(running, *trickle))
        await asyncio.sleep(BODY_TIMEOUT_S / 4)  # the head is in, the body is arriving
        usage = (await admin.get("/admin/v1/tenants/slow/usage")).json()
        # The tenant's one concurrent request is free for a request that arrives whole.
        served = await admin.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        answer = await slow
    assert (usage["concurrent"], usage["queued_here"]) == (0, 0), usage
    assert served.status_code == 200, served.text
    assert answer.status == 408
    assert answer.error()["code"] == "request_timeout"
    assert BODY_TIMEOUT_S <= answer.elapsed_s < BODY_TIMEOUT_S + 5


# The head: the request line and headers, bounded by the HTTP server.


async def test_headers_over_the_limit_are_431(running: Gateway) -> None:
    big = head(running, x_padding="a" * MAX_HEADERS)
    answer = await send_raw(running, big)
    assert answer.status == 431
    assert answer.error()["code"] == "headers_too_large"


async def test_a_header_that_never_ends_is_431_once_past_the_limit(running: Gateway) -> None:
    unfinished = head(running).removesuffix(b"\r\n") + b"X-Endless: "
    parts: list[bytes | float] = [unfinished] + [b"a" * 1024, 0.01] * (MAX_HEADERS // 1024 + 2)
    answer = await send_raw(running, *parts)
    assert answer.status == 431
    assert answer.error()["code"] == "headers_too_large"


async def test_a_head_sent_slowly_is_408(running: Gateway) -> None:
    answer = await send_raw(running, b"POST /v1/chat/completions HTTP/1.1\r\nHost: g")
    assert answer.status == 408
    assert answer.error()["code"] == "request_timeout"
    # Timed by the server from the connection's opening, a moment before this test's clock.
    assert 0.9 * HEAD_TIMEOUT_S <= answer.elapsed_s < HEAD_TIMEOUT_S + 5


async def test_a_request_the_server_cannot_parse_is_an_openai_400(running: Gateway) -> None:
    answer = await send_raw(running, b"\x00\x01 not http\r\n\r\n")
    assert answer.status == 400
    answer.error()


# Single fields, and the JSON they come in.


def _nested(lists: int) -> Any:
    """A string inside ``lists`` nested arrays: in a body's field, 1 + ``lists`` levels deep."""
    value: Any = "bottom"
    for _ in range(lists):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"n": 129}, "n", None),
        ({"n": True}, "n", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", None),
        ({"logit_bias": {"the": 1}}, "logit_bias.the", None),
        ({"logit_bias": {"42": 101}}, "logit_bias.42", None),
        ({"messages": HELLO * 2049}, "messages", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_tokens": "16"}, "max_tokens", None),
        ({"max_tokens": 4097}, "max_tokens", "max_tokens_too_large"),
        ({"max_tokens": 2**70}, "max_tokens", None),  # past 64 bits: not an integer at all
        ({"stream": "true"}, "stream", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        # The body is forwarded as sent, and JSON encoders stop at some depth: 300 levels were
        # a 500 before the limit (orjson: "Recursion limit reached").
        ({"metadata": _nested(300)}, None, "json_too_deep"),
        ({"metadata": _nested(64)}, None, "json_too_deep"),  # with the body's own: 65 levels
    ],
)
def test_a_field_past_its_limit_is_400_naming_it(
    running: Gateway, fields: dict[str, Any], param: str | None, code: str | None
) -> None:
    answer = _chat(running, {"model": MODEL, "messages": HELLO, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert_openai_error(answer.json())
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_a_body_nested_to_the_limit_is_served(running: Gateway) -> None:
    answer = _chat(running, {"model": MODEL, "messages": HELLO, "metadata": _nested(63)})
    assert answer.status_code == 200, answer.text


def test_integers_are_json_integers_as_the_document_says() -> None:
    # JSON Schema's integer holds 2.0 (and vLLM reads it as 2); never true or "2".
    body = {"model": MODEL, "messages": HELLO}
    read = ChatCompletionRequest.model_validate({**body, "max_tokens": 16.0, "n": 2.0})
    assert (read.max_tokens, read.n) == (16, 2)
    for wrong in (True, "2", 2.5):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({**body, "n": wrong})


@pytest.mark.parametrize(
    ("method", "path", "options", "param"),
    [
        ("POST", "/admin/v1/tenants", {"content": b"{oops"}, None),
        ("POST", "/admin/v1/tenants", {"json": {"name": "x", "tpm": True}}, "tpm"),
        ("GET", "/admin/v1/audit", {"params": {"limit": 0}}, "limit"),
        (
            "POST",
            "/admin/v1/deployments",
            {"json": {"version": "v", "decode_workers": "1"}},
            "decode_workers",
        ),
    ],
)
def test_admin_validation_is_400_naming_the_field(
    running: Gateway, method: str, path: str, options: dict[str, Any], param: str | None
) -> None:
    answer = httpx.request(
        method,
        f"{running.base_url}{path}",
        headers={
            "Authorization": f"Bearer {running.admin_key}",
            "Content-Type": "application/json",
        },
        timeout=10,
        **options,
    )
    assert answer.status_code == 400, answer.text
    assert_openai_error(answer.json())
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def _chat(gateway: Gateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/v1/chat/completions",
        content=json.dumps(body),  # not orjson: it refuses integers past 64 bits
        headers={"Authorization": f"Bearer {gateway.tenant_key}"},
        timeout=10,
    )
