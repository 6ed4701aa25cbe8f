"""``core/redis_pipe.py`` against a real redis-server: every caller's reply is its own, one
that left loses nothing for the others, and each failure of ``core/redis_conn.py``'s rules
(bounded, never retried blindly, back at the first call once Redis is) holds on one shared
connection."""

from __future__ import annotations

import asyncio
import time
from uuid import uuid4

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.redis_pipe import LuaScript, PipelinedRedis
from tests.redis_server import running_redis

pytestmark = pytest.mark.asyncio

ECHO_KEY = LuaScript("return {KEYS[1], ARGV[1]}")


async def test_each_concurrent_caller_gets_its_own_reply(redis_url: str) -> None:
    pipe = PipelinedRedis(redis_url, timeout_s=2.0)
    try:
        replies = await asyncio.gather(*(pipe.call("ECHO", f"m{i}") for i in range(300)))
        assert replies == [f"m{i}" for i in range(300)]
        scripted = await asyncio.gather(
            *(pipe.evalsha(ECHO_KEY, [f"k{i}"], [i]) for i in range(50))
        )
        assert scripted == [[f"k{i}", str(i)] for i in range(50)]
    finally:
        await pipe.aclose()


async def test_an_error_reply_raises_and_the_connection_goes_on(redis_url: str) -> None:
    pipe = PipelinedRedis(redis_url, timeout_s=2.0)
    key = f"test:{uuid4().hex}"
    try:
        await pipe.call("SET", key, "not a number")
        with pytest.raises(ResponseError, match="not an integer"):
            await pipe.call("INCR", key)
        assert await pipe.call("GET", key) == "not a number"
        assert await pipe.call("DEL", key) == 1
    finally:
        await pipe.aclose()


async def test_a_script_redis_does_not_know_is_loaded_and_run_once() -> None:
    script = LuaScript(f"return '{uuid4().hex}'")
    with running_redis() as server:
        pipe = PipelinedRedis(server.url, timeout_s=2.0)
        watcher = Redis.from_url(server.url)
        try:
            assert await pipe.evalsha(script, [], []) == script.source.split("'")[1]
            assert await watcher.script_exists(script.sha) == [True]
            await watcher.script_flush()  # as after a restart: the cache is empty
            assert await pipe.evalsha(script, [], []) == script.source.split("'")[1]
            stats = await watcher.info("commandstats")
            # Twice unknown (first call, after the flush), so loaded twice: nothing else.
            assert stats["cmdstat_evalsha"]["failed_calls"] == 2
            assert stats["cmdstat_script|load"]["calls"] == 2
        finally:
            await watcher.aclose()
            await pipe.aclose()


async def test_a_caller_that_leaves_keeps_its_place() -> None:
    with running_redis() as server:
        pipe = PipelinedRedis(server.url, timeout_s=5.0)
        try:
            await pipe.call("PING")
            server.pause()  # no reply until resumed: the first call is still waiting
            leaving = asyncio.ensure_future(pipe.call("ECHO", "first"))
            staying = asyncio.ensure_future(pipe.call("ECHO", "second"))
            await asyncio.sleep(0.1)
            leaving.cancel()
            server.resume()
            assert await staying == "second"  # the first reply went to nobody
            assert await pipe.call("ECHO", "third") == "third"
            assert leaving.cancelled()
        finally:
            server.resume()
            await pipe.aclose()


async def test_a_stalled_redis_times_out_every_waiting_call_and_is_used_again() -> None:
    with running_redis() as server:
        pipe = PipelinedRedis(server.url, timeout_s=0.3)
        try:
            await pipe.call("PING")
            server.pause()
            first = asyncio.ensure_future(pipe.call("ECHO", "a"))
            await asyncio.sleep(0.2)
            second = asyncio.ensure_future(pipe.call("ECHO", "b"))
            with pytest.raises(RedisTimeoutError):
                await first
            # Closed when the first timed out, before its own time was up.
            with pytest.raises(ConnectionError):
                await second
            server.resume()
            assert await pipe.call("ECHO", "back") == "back"  # a new connection, at once
        finally:
            server.resume()
            await pipe.aclose()


async def test_a_restarted_redis_fails_the_waiting_calls_and_serves_the_next_one() -> None:
    with running_redis() as server:
        pipe = PipelinedRedis(server.url, timeout_s=0.5)
        try:
            await pipe.call("PING")
            server.stop()
            started = time.monotonic()
            with pytest.raises(ConnectionError):
                await pipe.call("PING")
            with pytest.raises(ConnectionError):  # refused: the connect fails fast too
                await pipe.call("PING")
            assert time.monotonic() - started < 1.0
            server.start()
            assert await pipe.call("ECHO", "back") == "back"
        finally:
            await pipe.aclose()


async def test_the_url_brings_its_credentials_and_database() -> None:
    with running_redis() as server:
        admin = Redis.from_url(server.url)
        try:
            await admin.acl_setuser(
                "gateway", enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all"]
            )
            await admin.config_set("requirepass", "default-secret")
        finally:
            await admin.aclose()
        base = f"127.0.0.1:{server.port}"
        users = (f"redis://gateway:secret@{base}/3", f"redis://:default-secret@{base}/3")
        for url in users:
            pipe = PipelinedRedis(url, timeout_s=2.0)
            try:
                assert await pipe.call("SET", "where", url) == "OK"
            finally:
                await pipe.aclose()
        check = Redis.from_url(f"redis://:default-secret@{base}/3", decode_responses=True)
        try:
            assert await check.get("where") == users[-1]
        finally:
            await check.aclose()
        wrong = PipelinedRedis(f"redis://:wrong@{base}/0", timeout_s=2.0)
        try:
            with pytest.raises(ResponseError):
                await wrong.call("PING")
        finally:
            await wrong.aclose()


async def test_a_closed_client_refuses_calls(redis_url: str) -> None:
    pipe = PipelinedRedis(redis_url, timeout_s=2.0)
    await pipe.call("PING")
    await pipe.aclose()
    with pytest.raises(ConnectionError, match="closed"):
        await pipe.call("PING")
