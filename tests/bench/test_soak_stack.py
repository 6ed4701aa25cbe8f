"""The soak stack's readiness wait fails with what CI needs to tell why (it keeps no files)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from bench.soak.stack import SoakStack, StackError, StackSpec
from tests.http_app import served

REQUEST_LINE = "2026-12-01 02:14:18,607 INFO tandem.requests: request 1 failed"
WORKER_LINE = "2026-12-01 02:14:18,609 ERROR tandem.workers: decode-0 exited; restarting in 60 s"


def stack_with_logs(tmp_path: Path) -> SoakStack:
    stack = SoakStack(StackSpec(workdir=tmp_path))
    stack.log_path.write_text(f"{WORKER_LINE}\n{REQUEST_LINE}\n")
    stack.worker_log_dir.mkdir()
    (stack.worker_log_dir / "decode-0.log").write_text("OSError: [Errno 98] Address in use\n")
    return stack


async def test_a_stack_never_ready_says_what_it_saw_last_and_ends_with_the_logs(
    tmp_path: Path,
) -> None:
    stack = stack_with_logs(tmp_path)  # nothing listens on its port

    with pytest.raises(StackError) as raised:
        await stack.wait_ready(0.3)

    message = str(raised.value)
    assert "not ready within 0 s; last seen: ConnectError" in message
    assert WORKER_LINE in message
    assert REQUEST_LINE not in message  # one line a request: the workers' events would drown
    assert "the end of decode-0's log" in message
    assert "Address in use" in message


async def test_a_ready_gateway_with_a_silent_worker_names_the_worker(tmp_path: Path) -> None:
    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "workers": []})

    async def unhealthy(_: web.Request) -> web.Response:
        return web.Response(status=503)

    gateway, worker = web.Application(), web.Application()
    gateway.router.add_get("/ready", ready)
    worker.router.add_get("/health", unhealthy)
    stack = stack_with_logs(tmp_path)
    async with served(gateway) as gateway_url, served(worker) as worker_url:
        stack.base_url = gateway_url
        stack.worker_urls = {"decode": worker_url}
        with pytest.raises(StackError, match="200, but the decode worker's /health answered 503"):
            await stack.wait_ready(0.3)

        stack.worker_urls = {}
        assert await stack.wait_ready(0.3) == {"status": "ready", "workers": []}
