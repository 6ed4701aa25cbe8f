"""vLLM 0.32's OpenAI wire shapes, as bytes prepared ahead for the fast fake engine.

The shapes follow ``tests/fakes/fake_engine.py`` (whose docstring lists where each was
confirmed in vLLM's source): stream chunks without ``usage`` unless ``continuous_usage_stats``,
chat's role chunk first, the finish reason on the last token's chunk, the usage chunk with
``choices: []``, non-streamed answers with every field (nulls included) and the top-level
``kv_transfer_params`` a prefill worker's NixlConnector returns.

A stream's events are prepared once per response shape with the response id left out
(``prefix + id + suffix``), so sending one costs two byte concatenations.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

VLLM_VERSION = "0.32.0"
REQUIRED_REMOTE_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
"""What vLLM's decode side needs in leg 2's ``kv_transfer_params``."""
BLOCK_SIZE = 16
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")
_ID = "@@response-id@@"  # where the response id goes in a prepared event (JSON-safe)

Event = tuple[bytes, bytes]
"""A prepared SSE event: ``prefix + response id + suffix`` is ``data: {...}\\n\\n``."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What a streamed answer looks like, apart from its id."""

    model: str
    chat: bool
    prompt_tokens: int
    num_tokens: int
    finish_reason: str
    include_usage: bool
    continuous_usage: bool
    created: int


@dataclass(frozen=True, slots=True)
class Script:
    """A stream's prepared events."""

    first: tuple[Event, ...]
    """Sent with the first token, before it (chat's role chunk)."""
    tokens: tuple[Event, ...]
    """One per token; the last carries the finish reason."""
    tail: tuple[Event, ...]
    """After the last token (the usage chunk); ``data: [DONE]`` follows."""


def fingerprint(model: str) -> str:
    return f"vllm-{VLLM_VERSION}-{uuid.uuid5(uuid.NAMESPACE_DNS, model).hex[:8]}"


def token_text(k: int) -> str:
    """The ``k``-th output token's text (words, space-separated)."""
    word = _WORDS[k % len(_WORDS)]
    return word if k == 0 else " " + word


def stream_script(shape: Shape) -> Script:
    """Every event of a stream of ``shape``."""
    chat = shape.chat
    head = {
        "id": _ID,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": shape.created,
        "model": shape.model,
    }
    continuous = shape.continuous_usage and shape.include_usage  # vLLM: only with include_usage

    def usage(done: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": shape.prompt_tokens,
            "total_tokens": shape.prompt_tokens + done,
            "completion_tokens": done,
        }
        if chat:  # vLLM sets it to None explicitly there, so it is serialised
            out["completion_tokens_details"] = None
        return out

    first: list[dict[str, Any]] = []
    if chat:
        delta = {"role": "assistant", "content": ""}
        role: dict[str, Any] = {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": None,
            "prompt_text": None,
        }
        if continuous:
            role["usage"] = usage(0)
        first.append(role)
    tokens: list[dict[str, Any]] = []
    for k in range(shape.num_tokens):
        last = k == shape.num_tokens - 1
        piece = token_text(k)
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
        )
        choice.update(logprobs=None, finish_reason=shape.finish_reason if last else None)
        if last or not chat:
            choice["stop_reason"] = None
        if not chat:
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        chunk: dict[str, Any] = {**head, "choices": [choice]}
        if continuous:
            chunk["usage"] = usage(k + 1)
        if last and not shape.include_usage:
            chunk["system_fingerprint"] = fingerprint(shape.model)
        tokens.append(chunk)
    tail: list[dict[str, Any]] = []
    if shape.include_usage:
        final = {k: v for k, v in usage(shape.num_tokens).items() if v is not None}
        tail.append(
            {**head, "choices": [], "usage": final, "system_fingerprint": fingerprint(shape.model)}
        )
    return Script(
        tuple(map(_prepare, first)), tuple(map(_prepare, tokens)), tuple(map(_prepare, tail))
    )


def _prepare(chunk: dict[str, Any]) -> Event:
    prefix, suffix = orjson.dumps(chunk).split(_ID.encode(), 1)
    return b"data: " + prefix, suffix + b"\n\n"


def full_answer(
    rid: str,
    model: str,
    chat: bool,
    prompt_tokens: int,
    num_tokens: int,
    finish_reason: str,
    kv_transfer_params: dict[str, Any] | None,
) -> bytes:
    """A non-streamed answer (vLLM's ``model_dump()``: every field, nulls included)."""
    text = "".join(token_text(k) for k in range(num_tokens))
    choice: dict[str, Any]
    if chat:
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice = {"index": 0, "message": message}
    else:
        choice = {"index": 0, "text": text}
    choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None, token_ids=None)
    if not chat:
        choice.update(prompt_logprobs=None, prompt_token_ids=None)
    choice["routed_experts"] = None
    answer: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fingerprint(model),
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + num_tokens,
            "completion_tokens": num_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
    if chat:
        answer.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    answer.update(kv_transfer_params=kv_transfer_params, ec_transfer_params=None, metrics=None)
    return orjson.dumps(answer)


def produced_kv(engine_id: str, rid: str, prompt_tokens: int, first_block: int) -> dict[str, Any]:
    """Leg 1's ``kv_transfer_params``, as NixlConnectorScheduler.request_finished fills them."""
    num_blocks = max(1, -(-prompt_tokens // BLOCK_SIZE))
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(first_block, first_block + num_blocks))],
        "remote_engine_id": engine_id,
        "remote_request_id": f"{rid}-{os.urandom(4).hex()}",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }


def count_prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """The fake's prompt length: words, plus one per chat message (its role)."""
    if chat:
        total = 0
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                content = " ".join(str(part.get("text", "")) for part in content)
            total += 1 + len(str(content or "").split())
        return total
    prompt = body["prompt"]
    if isinstance(prompt, list):
        if all(isinstance(token, int) for token in prompt):
            return len(prompt)
        return len(" ".join(map(str, prompt)).split())
    return len(str(prompt).split())


def models_body(model: str, max_model_len: int) -> bytes:
    card = {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
    return orjson.dumps({"object": "list", "data": [card]})


def metrics_body(model: str, num_running: int) -> bytes:
    """The gauges the gateway reads from a worker's ``/metrics`` (Prometheus text)."""
    labels = f'engine="0",model_name="{model}"'
    gauges = (
        ("vllm:num_requests_running", "Requests in model execution batches.", num_running),
        ("vllm:num_requests_waiting", "Requests waiting to be processed.", 0),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", 0.0),
    )
    lines = []
    for name, doc, value in gauges:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    return ("\n".join(lines) + "\n").encode()


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """vLLM's error shape (``code`` is the HTTP status, an int)."""
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )
