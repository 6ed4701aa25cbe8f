"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from core.errors import InvalidRequestError
from core.messages import Endpoint
from core.request import Request, RequestPhase
from gateway.deadlines import TIMEOUT_HEADER, DeadlineConfig, request_deadline
from gateway.errors import invalid_request_from_validation
from gateway.execution import Execution
from gateway.gate import Gate
from gateway.pipeline import ServingPipeline
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.sse import serve_stream

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
    limits: DeadlineConfig = http_request.app.state.deadlines
    request = Request(
        request_id=uuid.uuid4().hex,
        model=model.name,
        stream=bool(body.get("stream")),
        tenant_id=caller.tenant.tenant_id,
        deadline=request_deadline(
            http_request.headers.get(TIMEOUT_HEADER), limits.default_s, limits.max_s
        ),
    )
    request.advance(RequestPhase.AUTHENTICATED)
    pipeline.check_decode_available()
    execution = Execution(
        gate, pipeline, caller, endpoint, body, request, model, _client_gone(http_request)
    )
    if request.stream:
        return await serve_stream(execution, ping_interval_s)
    result = await execution.complete()
    return Response(orjson.dumps(result), media_type="application/json", headers=execution.headers)


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
