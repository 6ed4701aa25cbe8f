"""503 and 502 from real workers: a second gateway over the live workers, miswired on purpose.

The session's gateway stays untouched; these gateways share its vLLM workers.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.app import AccessConfig, GatewayConfig, create_app
from gateway.assembly.stores import StoreConfig
from gateway.serving.upstream import UpstreamConfig
from tests.e2e.conftest import LiveStack
from tests.server_process import free_port_block
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Hi"}]


@contextmanager
def gateway_over(
    model: str, prefill_url: str, decode_url: str, served_as: str | None = None
) -> Iterator[openai.OpenAI]:
    """A gateway on its own thread and event loop over external workers at these URLs, which
    serve ``served_as`` (default: ``model``)."""
    port = free_port_block(1)
    state_dir = Path(tempfile.mkdtemp(prefix="tandem-e2e-"))
    started = threading.Event()
    stop = threading.Event()

    async def serve() -> None:
        pools = [
            WorkerPool(PoolConfig(role, external_urls=(url,), health_interval_s=0.2))
            for role, url in ((WorkerRole.PREFILL, prefill_url), (WorkerRole.DECODE, decode_url))
        ]
        for pool in pools:
            await pool.start()
        app = create_app(
            GatewayConfig(
                upstream=UpstreamConfig(),
                # Anonymous callers, tenants in a throwaway file: this gateway tests routing.
                access=AccessConfig(
                    auth_required=False, stores=StoreConfig(sqlite_path=state_dir / "t.db")
                ),
            ),
            Deployments(
                [Deployment(ServedModel(model, None, 0, served_as=served_as), pools[0], pools[1])]
            ),
        )
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # a few health rounds
        started.set()
        await asyncio.to_thread(stop.wait)
        server.should_exit = True
        await task
        for pool in pools:
            await pool.aclose()

    # uvicorn installs signal handlers only on the main thread; here it skips them.
    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(30), "second gateway did not start"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        yield client
    finally:
        stop.set()
        thread.join(30)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_no_healthy_decode_worker_is_503(live_stack: LiveStack) -> None:
    # A port held bound but never listening: connections are refused, and no other server
    # (such as the second gateway itself) can take it meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{held.getsockname()[1]}"
        _expect_503(live_stack, dead)


def _expect_503(live_stack: LiveStack, dead: str) -> None:
    with (
        gateway_over(live_stack.model, live_stack.prefill_url, dead) as client,
        pytest.raises(openai.APIStatusError) as caught,
    ):
        client.chat.completions.create(model=live_stack.model, messages=QUESTION, max_tokens=2)
    assert caught.value.status_code == 503
    assert caught.value.code == "no_healthy_worker"
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_engine_error_is_502_with_a_string_code(live_stack: LiveStack) -> None:
    # A gateway that serves a model name its decode worker does not know: vLLM answers 404
    # with an integer code; that is the engine's (configuration's) fault, so the client gets a
    # 502 with a string code.
    with (
        gateway_over("misnamed", live_stack.prefill_url, live_stack.decode_url) as client,
        pytest.raises(openai.InternalServerError) as caught,
    ):
        client.chat.completions.create(model="misnamed", messages=QUESTION, max_tokens=2)
    assert caught.value.status_code == 502
    assert caught.value.code == "engine_error"
    assert "decode-ext-0" in caught.value.message


LONG_PROMPT = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 40


def _long_request_metrics(client: openai.OpenAI, model: str) -> str:
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4
    )
    assert completion.choices[0].message.content
    return httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text


def test_prefill_leg_without_a_handle_falls_back_to_colocated(live_stack: LiveStack) -> None:
    # A "prefill worker" that answers the leg but is no KV producer (here: the session's own
    # gateway, which never returns kv_transfer_params): the answer still comes, colocated.
    with gateway_over(
        live_stack.model, live_stack.base_url, live_stack.decode_url, live_stack.version
    ) as client:
        metrics = _long_request_metrics(client, live_stack.model)
    assert re.search(r'path="fallback",reason="prefill_failed",version="[^"]+"\} 1\.0', metrics)


def test_dead_prefill_pool_falls_back_to_colocated(live_stack: LiveStack) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{held.getsockname()[1]}"
        with gateway_over(
            live_stack.model, dead, live_stack.decode_url, live_stack.version
        ) as client:
            metrics = _long_request_metrics(client, live_stack.model)
    assert re.search(r'path="fallback",reason="no_healthy_prefill",version="[^"]+"\} 1\.0', metrics)
