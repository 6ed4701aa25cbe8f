"""Bands as vLLM priorities on the real stack: the workers run ``--scheduling-policy priority``
and accept each band's priority on both legs (a 400 from either leg would reach the client)."""

from __future__ import annotations

import openai
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
