"""HTTP client to the vLLM workers: the gateway's hot path.

The requests themselves go over ``core/http1.py`` (kept-alive connections, one write a
request, httptools' parser): aiohttp cost 0.16 ms of a request's time to first token before
its first byte left. One aiohttp session stays, owned by ``EngineClient`` too, for the
gateway's other reads from workers (metrics, KV usage): aiohttp rather than httpx, measured
10-20x cheaper per request on a 2-core machine. Engine answers are translated here into
Tandem's errors, so nothing above sees the client's or vLLM's error shapes (whose ``code`` is
an int, which OpenAI clients do not accept).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
import orjson

from core.errors import (
    ContextLengthExceededError,
    EngineError,
    EngineTimeoutError,
    InvalidRequestError,
    TandemError,
)
from core.http1 import Http1Client, Http1Response
from core.messages import Endpoint
from gateway.serving.deadlines import deadline_error
from workers.registry import Worker

_CONTEXT_LENGTH_MARKERS = ("maximum context length", "context length", "max_model_len")
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Time limits for talking to workers."""

    connect_timeout_s: float = 5.0
    """Opening a connection; past it the worker counts as unreachable."""
    prefill_timeout_s: float = 120.0
    """The whole prefill leg (one token)."""
    decode_idle_timeout_s: float = 120.0
    """Longest silence from a decode worker (also bounds a whole non-streaming answer)."""
    first_byte_timeout_s: float = 30.0
    """Longest wait for a decode stream's first event, which vLLM sends with the first token,
    so after the KV transfer: past it the transfer counts as stalled."""


class EngineStream:
    """An open streaming response from a decode worker; yields SSE ``data`` payloads.

    Its silences and the request's deadline are watched by one timer per stream
    (``_watchdog``), armed for whichever comes first and re-armed only when it fires. Each
    network read just notes the time: a read timeout re-armed at every read would be a timer
    created and cancelled per chunk of every stream."""

    __slots__ = (
        "_bytes_read", "_deadline", "_heard_at", "_idle_timeout_s", "_payloads", "_peeking",
        "_response", "_watchdog", "_worker",
    )  # fmt: skip

    def __init__(self, response: Http1Response, worker: Worker, idle_timeout_s: float) -> None:
        """``idle_timeout_s``: the longest silence the worker may keep while it streams."""
        self._response = response
        self._worker = worker
        self._payloads = self._read()
        self._peeking = False
        """``read_first`` is waiting for the first payload only to see that it came."""
        self._idle_timeout_s = idle_timeout_s
        self._deadline: float | None = None
        self._heard_at = time.monotonic()
        """When the last network read returned (``time.monotonic()``)."""
        self._bytes_read = 0
        self._watchdog: asyncio.TimerHandle | None = None

    async def read_first(self, timeout_s: float) -> None:
        """Wait for the first event (it stays the first that ``events`` yields). vLLM answers a
        stream's headers at once but sends its first event with the first token, i.e. after the
        KV transfer: a stall shows here."""
        self._peeking = True
        try:
            async with asyncio.timeout(timeout_s):
                await anext(self._payloads, None)
        except TimeoutError as exc:
            raise EngineTimeoutError(
                f"decode worker {self._worker.name} sent no first token in {timeout_s:.0f} s"
            ) from exc

    def events(self, deadline: float | None = None) -> AsyncGenerator[bytes, None]:
        """Each event's payload (the bytes after ``data: ``), ending at ``[DONE]``; call it
        once, after ``read_first``.

        Raises ``EngineError`` if the worker ends the stream without ``[DONE]`` (it died or
        dropped the connection), ``EngineTimeoutError`` if it stays silent for the idle
        timeout, and ``DeadlineExceededError`` if ``deadline`` (``time.monotonic()``) passes
        first. Both bound the reads only, never the consumer's work between them.
        """
        self._deadline = deadline
        self._arm_watchdog()
        return self._payloads  # the reads themselves: no generator layered on them

    def _arm_watchdog(self) -> None:
        due = self._heard_at + self._idle_timeout_s
        if self._deadline is not None:
            due = min(due, self._deadline)
        delay_s = max(due - time.monotonic(), 0.0)
        self._watchdog = asyncio.get_running_loop().call_later(delay_s, self._watch)

    def _watch(self) -> None:
        """The watchdog fired: end the reads with the deadline's or the silence's error, or
        re-arm it (the worker spoke since it was armed; a timer may also fire a little early)."""
        self._watchdog = None
        now = time.monotonic()
        response = self._response
        if self._deadline is not None and now >= self._deadline:
            response.fail(deadline_error("while it was streaming"))
            return
        if self._bytes_read < response.bytes_received:
            # Bytes arrived that the consumer has not read yet: a slow client, not a silent
            # worker (the client stops reading the socket while its buffer is full).
            self._heard_at = now
        if now - self._heard_at >= self._idle_timeout_s:
            response.fail(
                EngineTimeoutError(f"decode worker {self._worker.name} went silent mid-stream")
            )
            return
        self._arm_watchdog()

    async def _read(self) -> AsyncGenerator[bytes, None]:
        # Whatever has arrived, split into lines here: one await per network read rather
        # than per line (an event is two lines, ``data: ...`` and a blank one).
        pending = b""
        response = self._response
        try:
            while data := await response.read_some():
                self._heard_at = time.monotonic()
                self._bytes_read += len(data)
                lines = (pending + data if pending else data).split(b"\n")
                pending = lines.pop()  # an unfinished line, or b"" after a line break
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators and SSE comments
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    if self._peeking:  # once more, as the first of ``events``
                        self._peeking = False
                        yield payload
                    yield payload
                # A stream spends most of its life waiting for its next read: it holds none of
                # this one meanwhile (the read, its lines and the last payload, a copy each).
                data = line = payload = b""
                lines.clear()
        except ConnectionError as exc:
            raise EngineError(f"decode worker {self._worker.name} broke the stream: {exc}") from exc
        finally:
            self._disarm_watchdog()
        raise EngineError(f"decode worker {self._worker.name} ended the stream without [DONE]")

    def _disarm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def close(self) -> None:
        """Drop the connection; vLLM aborts the request when its client goes away."""
        self._disarm_watchdog()
        self._response.close()


class EngineClient:
    """Pooled HTTP client to all workers. ``start()`` in the app lifespan, ``aclose()`` after."""

    def __init__(self, config: UpstreamConfig) -> None:
        self._config = config
        self._http: Http1Client | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._http = Http1Client(self._config.connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector, json_serialize=lambda obj: orjson.dumps(obj).decode()
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session, for other reads from workers (metrics)."""
        if self._session is None:
            raise RuntimeError("EngineClient.start() was not called")
        return self._session

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post_json(
        self,
        worker: Worker,
        path: str,
        body: dict[str, Any],
        request_id: str,
        *,
        prefill: bool,
        headers: Mapping[str, str] = _NO_HEADERS,
    ) -> dict[str, Any]:
        """POST a non-streaming request and return its JSON body, or raise a Tandem error.
        ``headers`` go along (the trace context of the leg)."""
        limit = self._config.prefill_timeout_s if prefill else self._config.decode_idle_timeout_s
        response: Http1Response | None = None
        try:
            async with asyncio.timeout(limit):
                response = await self._post(worker, path, body, request_id, headers)
                data = await response.read()
        except TimeoutError as exc:
            raise EngineTimeoutError(
                f"worker {worker.name} did not answer in time (limit {limit:.0f} s, "
                f"connect {self._config.connect_timeout_s:.0f} s)"
            ) from exc
        except ConnectionError as exc:
            raise EngineError(f"worker {worker.name} is unreachable: {exc}") from exc
        finally:
            if response is not None:
                response.close()  # read to its end: pooled again; else dropped (vLLM aborts)
        if response.status != 200:
            raise engine_status_error(worker, path, response.status, data)
        return _json_object(worker, data)

    async def open_stream(
        self,
        worker: Worker,
        path: str,
        body: dict[str, Any],
        request_id: str,
        headers: Mapping[str, str] = _NO_HEADERS,
    ) -> EngineStream:
        """POST a streaming request; return once the worker sent its first event.

        Errors before the first token surface here, while the gateway can still answer with a
        proper HTTP status (or retry) instead of an error event inside a 200 stream.
        """
        # The head is awaited under one timeout, the first event under another, and the
        # stream's silences by its own watchdog (``EngineStream``).
        idle_s = self._config.decode_idle_timeout_s
        try:
            async with asyncio.timeout(idle_s):
                response = await self._post(worker, path, body, request_id, headers)
        except TimeoutError as exc:
            raise EngineTimeoutError(f"worker {worker.name} did not answer") from exc
        except ConnectionError as exc:
            raise EngineError(f"worker {worker.name} is unreachable: {exc}") from exc
        if response.status != 200:
            try:
                async with asyncio.timeout(idle_s):
                    data = await response.read()
            except (ConnectionError, TimeoutError):
                data = b""
            finally:
                response.close()
            raise engine_status_error(worker, path, response.status, data)
        stream = EngineStream(response, worker, idle_s)
        try:
            await stream.read_first(min(self._config.first_byte_timeout_s, idle_s))
        except BaseException:
            stream.close()  # vLLM aborts the stalled request when its client goes away
            raise
        return stream

    async def _post(
        self,
        worker: Worker,
        path: str,
        body: dict[str, Any],
        request_id: str,
        headers: Mapping[str, str],
    ) -> Http1Response:
        if self._http is None:
            raise RuntimeError("EngineClient.start() was not called")
        return await self._http.post(
            worker.base_url,
            path,
            orjson.dumps(body),
            (("X-Request-Id", request_id), *headers.items()),
        )


def engine_status_error(worker: Worker, path: str, status: int, data: bytes) -> TandemError:
    """Translate a worker's non-200 answer into the error the client should see.

    A 400 from vLLM is about the client's request (its tokenizer is the authority on prompt
    length), so it is passed on with its message; anything else is the engine's fault: 502.
    """
    message = _engine_message(data)
    if status == 400:
        if any(marker in message.lower() for marker in _CONTEXT_LENGTH_MARKERS):
            if "max_tokens" in message:
                param = "max_tokens"  # the output asked for alone exceeds the window
            else:
                param = "messages" if path == Endpoint.CHAT else "prompt"
            return ContextLengthExceededError(message, param=param)
        return InvalidRequestError(message)
    return EngineError(f"worker {worker.name} failed with HTTP {status}: {message}")


def _engine_message(data: bytes) -> str:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data[:200].decode(errors="replace") or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return data[:200].decode(errors="replace")


def _json_object(worker: Worker, data: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"worker {worker.name} answered with invalid JSON") from exc
    if not isinstance(body, dict):
        raise EngineError(f"worker {worker.name} answered with JSON that is not an object")
    return body
