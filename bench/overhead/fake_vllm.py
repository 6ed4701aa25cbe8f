"""A fast fake vLLM 0.32 worker for overhead benchmarks: vLLM's wire shapes, little CPU per token.

    python -m bench.overhead.fake_vllm --port 8300 --tokens 32 --itl-ms 20 --ttft-ms 0

prints ``FAKE_VLLM_READY http://HOST:PORT`` once it listens. ``tests/fakes/fake_engine.py`` is the
thorough fake for gateway tests (faults, stop strings, KV leases); this one keeps what a serving
gateway uses, on a raw asyncio protocol (``fake_http``) with every event's bytes prepared ahead
(``vllm_wire``), so a streamed token costs one timer callback and one ``transport.write``:

- ``GET /health`` (200), ``GET /v1/models``, ``GET /metrics`` (the gauges the gateway reads),
  ``GET /_fake/stats`` (the fake's counters and last bodies; vLLM has no such route).
- ``POST /v1/chat/completions`` and ``/v1/completions``, streamed (role chunk, token chunks, the
  finish reason on the last, usage chunk with ``include_usage``, ``usage`` on every chunk with
  ``continuous_usage_stats``, ``data: [DONE]``) or not.
- Leg 1 (``kv_transfer_params.do_remote_decode``): a non-streamed answer carrying the
  ``kv_transfer_params`` vLLM's NixlConnector returns. Leg 2 (``do_remote_prefill``): the keys a
  decode worker needs must be there, else vLLM's 500 (``kv_load_failure_policy=fail``).

Timing: the first token ``ttft`` after arrival (``kv_ttft`` for a leg 2: its prompt is not
recomputed), then one every ``itl``, at absolute times (no drift); ``min(tokens, max_tokens)``
tokens, finish reason ``length`` when ``max_tokens`` cut it, else ``stop``. Prompt tokens are the
prompt's words. Not modelled: ``n > 1``, stop strings, logprobs, tools, faults.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.overhead import vllm_wire as wire
from bench.overhead.fake_http import Exchange, HttpRequest, serve

_MAX_SCRIPTS = 512
_STREAM_CONTENT_TYPE = b"text/event-stream; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Timing:
    """How the fake engine paces its output."""

    num_tokens: int = 32
    """Tokens per answer (fewer when ``max_tokens`` is lower)."""
    itl_s: float = 0.020
    """Gap between consecutive tokens."""
    ttft_s: float = 0.0
    """Arrival to first token of a request that computes its prompt (colocated, or leg 1)."""
    kv_ttft_s: float = 0.0
    """Arrival to first token of a decode leg whose KV a prefill worker computed."""


@dataclass(slots=True)
class FakeStats:
    """What the fake served (``GET /_fake/stats``)."""

    requests: int = 0
    prefill_legs: int = 0
    decode_legs: int = 0
    kv_failures: int = 0
    streams: int = 0
    running: int = 0
    events: int = 0
    aborted: int = 0
    rejected: int = 0
    last_bodies: list[dict[str, Any]] = field(default_factory=list)
    """The last few generation request bodies (tests check what a gateway sent)."""


class FakeVllm:
    """One fake worker's routes; ``handle`` is the ``fake_http`` handler."""

    def __init__(self, model: str, timing: Timing, max_model_len: int = 4096) -> None:
        self.model = model
        self.timing = timing
        self.max_model_len = max_model_len
        self.engine_id = str(uuid.uuid4())
        self.stats = FakeStats()
        self.loop = asyncio.get_running_loop()
        self._scripts: dict[wire.Shape, wire.Script] = {}
        self._next_block = 1

    def handle(self, request: HttpRequest, exchange: Exchange) -> None:
        path, method = request.path, request.method
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            self._generate(request, exchange, chat=path == "/v1/chat/completions")
        elif method == "GET" and path == "/health":
            exchange.send(200, b"")
        elif method == "GET" and path == "/v1/models":
            exchange.send(200, wire.models_body(self.model, self.max_model_len))
        elif method == "GET" and path == "/metrics":
            body = wire.metrics_body(self.model, self.stats.running)
            exchange.send(200, body, b"text/plain; version=0.0.4; charset=utf-8")
        elif method == "GET" and path == "/_fake/stats":
            exchange.send(200, orjson.dumps(self.stats))
        else:
            exchange.send(404, wire.error_body(404, f"no route {method} {path}", "NotFoundError"))

    def _generate(self, request: HttpRequest, exchange: Exchange, *, chat: bool) -> None:
        stats = self.stats
        try:
            body = orjson.loads(request.body)
            prompt_tokens = wire.count_prompt_tokens(body, chat)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            stats.rejected += 1
            exchange.send(400, wire.error_body(400, f"bad request: {exc!r}", "BadRequestError"))
            return
        if body.get("model") != self.model:
            stats.rejected += 1
            message = f"The model `{body.get('model')}` does not exist."
            exchange.send(404, wire.error_body(404, message, "NotFoundError", "model"))
            return
        stats.requests += 1
        stats.last_bodies = [*stats.last_bodies[-7:], body]
        kv = body.get("kv_transfer_params") or {}
        # vLLM's response id: the prefix plus the X-Request-Id the gateway sends.
        rid = ("chatcmpl-" if chat else "cmpl-") + (
            request.headers.get("x-request-id") or os.urandom(8).hex()
        )
        delay = self.timing.ttft_s
        if kv.get("do_remote_prefill"):
            stats.decode_legs += 1
            if any(kv.get(key) is None for key in wire.REQUIRED_REMOTE_KEYS):
                stats.kv_failures += 1
                error = wire.error_body(500, "Internal server error", "InternalServerError")
                exchange.send(500, error)
                return
            delay = self.timing.kv_ttft_s
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        num_tokens, finish = self.timing.num_tokens, "stop"
        if isinstance(max_tokens, int) and max_tokens <= num_tokens:
            num_tokens, finish = max_tokens, "length"
        if kv.get("do_remote_decode"):
            stats.prefill_legs += 1
            produced = wire.produced_kv(self.engine_id, rid, prompt_tokens, self._next_block)
            self._next_block += len(produced["remote_block_ids"][0])
            answer = wire.full_answer(
                rid, self.model, chat, prompt_tokens, num_tokens, finish, produced
            )
            self._answer_later(delay, exchange, answer)
        elif body.get("stream"):
            options = body.get("stream_options") or {}
            shape = wire.Shape(
                model=self.model,
                chat=chat,
                prompt_tokens=prompt_tokens,
                num_tokens=num_tokens,
                finish_reason=finish,
                include_usage=bool(options.get("include_usage")),
                continuous_usage=bool(options.get("continuous_usage_stats")),
                created=int(time.time()),
            )
            _Stream(self, exchange, self._script(shape), rid.encode(), delay)
        else:
            delay += self.timing.itl_s * (num_tokens - 1)
            answer = wire.full_answer(
                rid, self.model, chat, prompt_tokens, num_tokens, finish, None
            )
            self._answer_later(delay, exchange, answer)

    def _script(self, shape: wire.Shape) -> wire.Script:
        script = self._scripts.get(shape)
        if script is None:
            if len(self._scripts) >= _MAX_SCRIPTS:  # ``created`` moves on every second
                self._scripts.clear()
            script = self._scripts[shape] = wire.stream_script(shape)
        return script

    def _answer_later(self, delay_s: float, exchange: Exchange, answer: bytes) -> None:
        stats = self.stats
        stats.running += 1

        def send() -> None:
            stats.running -= 1
            exchange.send(200, answer)

        timer = self.loop.call_later(delay_s, send)

        def aborted() -> None:
            timer.cancel()
            stats.running -= 1
            stats.aborted += 1

        exchange.on_abort = aborted


class _Stream:
    """One streamed answer, driven by loop timers (no task, no coroutine per stream)."""

    __slots__ = ("_engine", "_exchange", "_k", "_rid", "_script", "_start", "_timer")

    def __init__(
        self, engine: FakeVllm, exchange: Exchange, script: wire.Script, rid: bytes, delay_s: float
    ) -> None:
        self._engine, self._exchange, self._script, self._rid = engine, exchange, script, rid
        self._k = 0
        engine.stats.streams += 1
        engine.stats.running += 1
        exchange.on_abort = self._abort
        # vLLM answers the headers at once and sends the first event with the first token.
        exchange.start_stream(_STREAM_CONTENT_TYPE)
        self._start = engine.loop.time() + delay_s
        self._timer = engine.loop.call_at(self._start, self._tick)

    def _tick(self) -> None:
        script, k = self._script, self._k
        events = [*script.first, script.tokens[k]] if k == 0 else [script.tokens[k]]
        self._k = k = k + 1
        done = k >= len(script.tokens)
        if done:
            events += script.tail
        rid = self._rid
        data = b"".join(prefix + rid + suffix for prefix, suffix in events)
        stats = self._engine.stats
        stats.events += len(events)
        if done:
            stats.running -= 1
            self._exchange.end_stream(data + b"data: [DONE]\n\n")
            return
        self._exchange.write_chunk(data)
        at = self._start + k * self._engine.timing.itl_s
        self._timer = self._engine.loop.call_at(at, self._tick)

    def _abort(self) -> None:
        self._timer.cancel()
        self._engine.stats.running -= 1
        self._engine.stats.aborted += 1


async def run(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM."""
    timing = Timing(
        num_tokens=args.tokens,
        itl_s=args.itl_ms / 1000,
        ttft_s=args.ttft_ms / 1000,
        kv_ttft_s=args.kv_ttft_ms / 1000,
    )
    engine = FakeVllm(args.served_model_name, timing)
    server = await serve(engine.handle, args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    print(f"FAKE_VLLM_READY http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fast fake vLLM worker for overhead benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--served-model-name", default="fake-model")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--itl-ms", type=float, default=20.0, help="gap between tokens")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="first token (prompt computed)")
    parser.add_argument(
        "--kv-ttft-ms", type=float, default=0.0, help="first token of a decode leg (KV received)"
    )
    args = parser.parse_args(argv)
    import uvloop  # uvicorn[standard] brings it; cheaper timers and writes than asyncio's loop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
