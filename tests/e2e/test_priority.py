"""Bands as vLLM priorities on the real stack: the workers run ``--scheduling-policy priority``
and accept each band's priority on both legs (a 400 from either leg would reach the client)."""

from __future__ import annotations

import openai
import psutil
import pytest

from tests.e2e.conftest import LiveStack

pytestmark = pytest.mark.e2e

# Long enough to be split across the prefill and the decode worker: both legs carry it.
LONG_QUESTION = [
    {"role": "user", "content": "Colours: " + "red, green, blue, " * 80 + "Name one colour."}
]


@pytest.mark.parametrize("band", ["interactive", "batch"])
def test_every_band_is_served_by_priority_scheduled_workers(
    live_stack: LiveStack, band: str
) -> None:
    key = live_stack.new_tenant(f"priority-{band}", band=band)
    client = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(
        model=live_stack.model, messages=LONG_QUESTION, max_tokens=4, temperature=0
    )
    assert answer.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(
        model=live_stack.model, messages=LONG_QUESTION, max_tokens=4, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with live_stack.admin as admin:
        metrics = admin.get("/metrics").text
    assert 'path="disaggregated"' in metrics  # the long prompts took both legs


def test_decode_workers_bound_each_engine_step(live_stack: LiveStack) -> None:
    """``TANDEM_DECODE_STEP_TOKENS`` (64): a colocated prompt's prefill shares a decode step
    with every running stream, so decode workers cap the tokens one step computes; prefill
    workers keep vLLM's larger default (they run no streams)."""
    servers: dict[str, list[str]] = {}
    for proc in psutil.Process(live_stack.pid).children(recursive=True):
        cmdline = proc.cmdline()
        if "--port" in cmdline and "vllm.entrypoints.openai.api_server" in cmdline:
            servers[cmdline[cmdline.index("--port") + 1]] = cmdline
    decode = servers[live_stack.decode_url.rsplit(":", 1)[-1]]
    prefill = servers[live_stack.prefill_url.rsplit(":", 1)[-1]]
    assert decode[decode.index("--max-num-batched-tokens") + 1] == "64"
    assert "--max-num-batched-tokens" not in prefill
