"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from core.errors import InvalidRequestError, TandemError
from core.messages import Endpoint
from core.request import Request, RequestPhase
from gateway.errors import invalid_request_from_validation
from gateway.gate import Gate
from gateway.pipeline import ServingPipeline
from gateway.relay import RelayStream
from gateway.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()


def get_pipeline(http_request: HttpRequest) -> ServingPipeline:
    """The app's pipeline, built in the lifespan (tests may override this dependency)."""
    pipeline: ServingPipeline = http_request.app.state.pipeline
    return pipeline


def get_gate(http_request: HttpRequest) -> Gate:
    gate: Gate = http_request.app.state.gate
    return gate


def get_ping_interval(http_request: HttpRequest) -> float:
    interval: float = http_request.app.state.sse_ping_interval_s
    return interval


PipelineDep = Annotated[ServingPipeline, Depends(get_pipeline)]
GateDep = Annotated[Gate, Depends(get_gate)]
PingDep = Annotated[float, Depends(get_ping_interval)]


class OpenAIEventStream(EventSourceResponse):
    """Data-only SSE as the OpenAI SDKs expect: ``\\n`` separators, ``: ping`` heartbeats.

    The relay is closed and ``on_close`` awaited however the response ends, even if the client
    left before the first event (then the body generator never runs, so its own cleanup could
    not).
    """

    def __init__(
        self,
        relay: RelayStream,
        headers: dict[str, str],
        ping_interval_s: float,
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(
            relay.events(),
            sep="\n",
            ping=ping_interval_s,
            ping_message_factory=lambda: ServerSentEvent(comment="ping"),
            headers={"Cache-Control": "no-cache", **headers},
        )
        self._relay = relay
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.aclose()
            await self._on_close()


@router.post("/v1/chat/completions")
async def chat_completions(
    http_request: HttpRequest, pipeline: PipelineDep, gate: GateDep, ping_interval_s: PingDep
) -> Response:
    """OpenAI chat completions, streaming or not."""
    return await _serve(
        Endpoint.CHAT, ChatCompletionRequest, http_request, pipeline, gate, ping_interval_s
    )


@router.post("/v1/completions")
async def completions(
    http_request: HttpRequest, pipeline: PipelineDep, gate: GateDep, ping_interval_s: PingDep
) -> Response:
    """OpenAI (legacy) text completions, streaming or not."""
    return await _serve(
        Endpoint.COMPLETIONS, CompletionRequest, http_request, pipeline, gate, ping_interval_s
    )


@router.get("/v1/models")
async def list_models(
    http_request: HttpRequest, pipeline: PipelineDep, gate: GateDep
) -> dict[str, Any]:
    """The served models, in OpenAI's list shape (a key is needed, as on OpenAI)."""
    await gate.authenticate(http_request.headers.get("authorization"))
    return {
        "object": "list",
        "data": [
            {
                "id": model.name,
                "object": "model",
                "created": model.created,
                "owned_by": "tandem",
                "max_model_len": model.max_model_len,
            }
            for model in pipeline.models
        ],
    }


async def _serve(
    endpoint: Endpoint,
    schema: type[BaseModel],
    http_request: HttpRequest,
    pipeline: ServingPipeline,
    gate: Gate,
    ping_interval_s: float,
) -> Response:
    caller = await gate.authenticate(http_request.headers.get("authorization"))
    body = await _json_body(http_request)
    try:
        schema.model_validate(body)  # the client's own JSON is what the engine gets
    except ValidationError as exc:
        raise invalid_request_from_validation(exc) from exc
    model = pipeline.check_model(str(body["model"]))
    request = Request(
        request_id=uuid.uuid4().hex,
        model=model.name,
        stream=bool(body.get("stream")),
        tenant_id=caller.tenant.tenant_id,
    )
    request.advance(RequestPhase.AUTHENTICATED)
    pipeline.check_decode_available()
    admission = await gate.admit(
        caller, endpoint, body, request, model.max_model_len, _client_gone(http_request)
    )
    headers = {
        "x-request-id": request.request_id,
        "x-tandem-queue-ms": str(round((request.queue_wait_s or 0.0) * 1000)),
        **admission.headers(),
    }
    try:
        if request.stream:
            # Settled before [DONE] when the stream ends normally; on_close covers the rest
            # (client gone, never started). Settling twice is a no-op.
            settle = functools.partial(gate.settle, admission, request)
            relay = await pipeline.stream(endpoint, body, request, admission.charge_output, settle)
            return OpenAIEventStream(relay, headers, ping_interval_s, settle)
        result = await pipeline.complete(endpoint, body, request)
    except TandemError as exc:
        # An error after admission still carries the request id and rate-limit headers.
        exc.extra_headers = {**headers, **exc.extra_headers}
        await gate.settle(admission, request)
        raise
    except BaseException:
        await gate.settle(admission, request)
        raise
    await gate.settle(admission, request)
    return Response(orjson.dumps(result), media_type="application/json", headers=headers)


def _client_gone(http_request: HttpRequest) -> Callable[[], Awaitable[None]]:
    """Waits for the client to hang up. Only for after the body was read: then the server's
    next message is the disconnect (a cancelled wait consumes nothing)."""

    async def wait() -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass

    return wait


async def _json_body(http_request: HttpRequest) -> dict[str, Any]:
    raw = await http_request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(
            "We could not parse the JSON body of your request: send a JSON object with "
            "Content-Type: application/json."
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body
