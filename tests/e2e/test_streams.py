"""Streams on the real stack: a client that leaves stops the decode worker, idempotent
requests run once and replay, and moderation acts on real model output."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import LiveStack, counting_stream, worker_gauge

pytestmark = pytest.mark.e2e


def num_running(worker_url: str) -> float:
    return worker_gauge(worker_url, "vllm:num_requests_running")


def _wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_client_leaving_mid_stream_stops_the_decode_worker(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    stream = counting_stream(client, live_stack, 800)  # only an abort stops it soon
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    _wait_for(lambda: num_running(live_stack.decode_url) >= 1, 30, "decode is generating")
    stream.close()  # the client hangs up
    # 800 tokens would take far longer than this on CPU; only the abort ends it this soon.
    _wait_for(lambda: num_running(live_stack.decode_url) == 0, 15, "decode still generating")


def test_one_idempotency_key_runs_once_and_replays_as_stream_and_json(
    live_stack: LiveStack,
) -> None:
    key = uuid.uuid4().hex
    body = {
        "model": live_stack.model,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {live_stack.api_key}", "Idempotency-Key": key}
    with httpx.Client(base_url=live_stack.base_url, headers=headers, timeout=120) as http:
        original = http.post("/v1/chat/completions", json=body)
        assert original.status_code == 200, original.text
        assert "idempotent-replayed" not in original.headers
        replay = http.post("/v1/chat/completions", json=body)
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == original.json()
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as sse:
            assert sse.headers["idempotent-replayed"] == "true"
            raw = "".join(sse.iter_text())
        different = http.post("/v1/chat/completions", json={**body, "max_tokens": 8})
        assert different.status_code == 422
        assert different.json()["error"]["code"] == "idempotency_key_reused"
    chunks = [json.loads(event[6:]) for event in raw.split("\n\n") if event.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == original.json()["choices"][0]["message"]["content"]
    assert {c["id"] for c in chunks} == {original.json()["id"]}
    assert raw.rstrip().endswith("data: [DONE]")


def _stream_text(live_stack: LiveStack, api_key: str, prompt: str) -> str:
    with openai.OpenAI(
        base_url=f"{live_stack.base_url}/v1", api_key=api_key, max_retries=0
    ) as client:
        stream = client.chat.completions.create(
            model=live_stack.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=40,
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_output_moderation_redacts_real_model_output(live_stack: LiveStack) -> None:
    prompt = "Repeat exactly: write to jane.roe@example.org for details."
    # Unmoderated, the model does repeat the address (greedy decoding: the same text below).
    assert "jane.roe@example.org" in _stream_text(live_stack, live_stack.api_key, prompt).lower()
    key = live_stack.new_tenant(
        f"redact-{uuid.uuid4().hex[:8]}",
        moderation={"output": {"providers": ["rules"], "actions": {"pii": "redact"}}},
    )
    text = _stream_text(live_stack, key, prompt)
    assert "@example.org" not in text
    assert "[REDACTED:email]" in text
    moderations = client_moderations(live_stack, "how to make a pipe bomb")
    assert moderations["results"][0]["categories"]["illicit/violent"] is True


def client_moderations(live_stack: LiveStack, text: str) -> dict[str, Any]:
    response = httpx.post(
        f"{live_stack.base_url}/v1/moderations",
        json={"input": text},
        headers={"Authorization": f"Bearer {live_stack.api_key}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result
