"""One Redis connection that every caller shares, its commands pipelined: for the calls on
every request's path (the quota store's scripts, ``admission/quota_redis.py``).

Through redis-py's pool a request's reserve-and-settle pair cost the gateway 98-117 µs of
CPU (a connection checked out, health-checked and given back per call, each command packed in
Python, a socket wakeup per reply); the quota store over one shared connection 29-46 µs
(``python -m bench.quota_store_calls``, 64 and one pair at a time). Redis answers one
connection's commands in order, so each reply is its oldest waiting call's; commands called in
one turn of the event loop go out in one write, and the replies that came together are read
in one wakeup.

The rules are ``core/redis_conn.py``'s: every call bounded, nothing retried blindly.

- A call with no reply within ``timeout_s`` raises redis-py's ``TimeoutError``, and the
  connection is closed: every later reply on it would be as late (Redis stalled, or the
  network). The calls still waiting on it fail with ``ConnectionError``.
- A connection lost (Redis restarted, a reset) fails every call waiting on it with
  ``ConnectionError``; the next call opens a new one (also within ``timeout_s``), so a
  restarted Redis is used again at its first call.
- A call whose caller was cancelled keeps its place: its reply is read and dropped.
- Only a script Redis does not know (``NOSCRIPT``: it did not run; its cache is empty after a
  restart) is sent again, once, after loading it.

The errors are redis-py's (``redis.exceptions``), as from the other stores. The URL is
``TANDEM_REDIS_URL``'s: ``redis://``, ``rediss://`` (TLS, the system's trusted CAs) or
``unix://``, with a user, password and ``db``. Not for blocking commands, transactions or
pub/sub, which hold a connection to themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | int | float | bytes


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script called by its SHA-1 (``EVALSHA``), loaded when Redis does not know it."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()
        object.__setattr__(self, "sha", sha)


class PipelinedRedis:
    """One shared connection to the Redis at ``url`` (see the module's docstring), opened at
    the first call."""

    def __init__(self, url: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        self._options = parse_url(url)
        self._timeout_s = timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._closed = False

    async def call(self, *args: Arg) -> Any:
        """Send one command and return its reply (an error reply raises ``ResponseError``)."""
        conn = await self._connection()
        reply = conn.send(args)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await reply
        except TimeoutError:
            conn.close()  # stalled: each later reply on it would be as late
            raise RedisTimeoutError(f"Redis sent no reply within {self._timeout_s:g} s") from None

    async def evalsha(self, script: LuaScript, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run ``script``; one it does not know is loaded and run once more (it did not run)."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.call("SCRIPT", "LOAD", script.source)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    async def aclose(self) -> None:
        """Close the connection; calls still waiting fail with ``ConnectionError``."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.close()

    async def _connection(self) -> _Connection:
        if self._closed:
            raise ConnectionError("this Redis client is closed")
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        if self._connecting is None:
            # One connect for every caller that finds none; a caller that leaves does not
            # cancel it for the others (shield).
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, connecting: asyncio.Future[_Connection]) -> None:
        self._connecting = None
        if connecting.cancelled() or connecting.exception() is not None:
            return
        self._conn = connecting.result()
        if self._closed:  # closed while the connect finished
            self._conn.close()

    async def _connect(self) -> _Connection:
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                conn = await self._open()
                # gather: a failed AUTH also fails the SELECT behind it, and that is read too.
                await asyncio.gather(*(conn.send(command) for command in self._handshake()))
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, TimeoutError):  # asyncio's
                raise RedisTimeoutError(
                    f"could not connect to Redis within {self._timeout_s:g} s"
                ) from None
            if isinstance(exc, OSError):
                raise ConnectionError(f"could not connect to Redis: {exc}") from exc
            raise  # an error reply (a wrong password, a db that does not exist), a cancel
        return conn

    async def _open(self) -> _Connection:
        options = self._options
        loop = asyncio.get_running_loop()
        if "path" in options:
            _, conn = await loop.create_unix_connection(_Connection, options["path"])
            return conn
        tls = (
            ssl.create_default_context()
            if options.get("connection_class") is SSLConnection
            else None
        )
        _, conn = await loop.create_connection(
            _Connection, options.get("host", "localhost"), options.get("port", 6379), ssl=tls
        )
        return conn

    def _handshake(self) -> list[tuple[Arg, ...]]:
        """What a new connection sends first: its credentials and database."""
        options = self._options
        commands: list[tuple[Arg, ...]] = []
        if options.get("password") is not None:
            user = options.get("username")
            credentials = (user, options["password"]) if user else (options["password"],)
            commands.append(("AUTH", *credentials))
        if options.get("db"):
            commands.append(("SELECT", options["db"]))
        return commands


class _Connection(asyncio.Protocol):
    """The socket: commands written in order, each reply handed to the oldest waiting call."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._unsent: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self.lost: ConnectionError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, args: Sequence[Arg]) -> asyncio.Future[Any]:
        """The future of ``args``'s reply; the command goes out at the end of this turn of
        the event loop, with any others sent in it."""
        if self.lost is not None:
            raise ConnectionError(*self.lost.args)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        self._waiting.append(reply)
        if not self._unsent:
            loop.call_soon(self._write)
        self._unsent.append(hiredis.pack_command(cast(Any, tuple(args))))  # stub: a 1-tuple
        return reply

    def _write(self) -> None:
        unsent, self._unsent = self._unsent, []
        if self.lost is None and self._transport is not None:
            self._transport.writelines(unsent)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                waiting = self._waiting.popleft()
                if waiting.done():  # its caller left: the reply is dropped
                    continue
                if isinstance(reply, ResponseError):
                    waiting.set_exception(_error_of(reply))
                else:
                    waiting.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked
            self._lose(ConnectionError(f"Redis's reply could not be read: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(ConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def close(self) -> None:
        """Close it now: the calls waiting on it fail."""
        self._lose(ConnectionError("connection to Redis closed"))

    def _lose(self, error: ConnectionError) -> None:
        if self.lost is None:
            self.lost = error
        if self._transport is not None:
            self._transport.abort()
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.done():
                waiting.set_exception(ConnectionError(*self.lost.args))


def _error_of(reply: ResponseError) -> ResponseError:
    message = str(reply)
    return NoScriptError(message) if message.startswith("NOSCRIPT") else reply
