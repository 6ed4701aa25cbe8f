"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/v1/moderations``."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from admission.idempotency import HEADER as IDEMPOTENCY_HEADER
from admission.idempotency import StoredResponse, fingerprint, parse_idempotency_key
from billing.records import idempotent_record_id
from billing.service import Billing
from core.errors import InvalidRequestError, TandemError
from core.messages import Endpoint
from core.request import Request, RequestPhase
from gateway.content_policy import ContentPolicy
from gateway.deadlines import TIMEOUT_HEADER, DeadlineConfig, request_deadline
from gateway.errors import invalid_request_from_validation
from gateway.execution import Execution
from gateway.gate import Gate
from gateway.idempotent import IdempotentKey, IdempotentRuns, replay_response
from gateway.metrics import GatewayMetrics
from gateway.pipeline import ServingPipeline
from gateway.replay import StreamAssembler
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.sse import StreamSource, serve_stream
from gateway.usage_records import UsageRecorder
from moderation.openai_shape import moderation_response, parse_moderation_input

router = APIRouter()


@dataclass(frozen=True, slots=True)
class OpenAIServices:
    """What the OpenAI routes use, built in the app's lifespan."""

    pipeline: ServingPipeline
    gate: Gate
    content: ContentPolicy
    idempotency: IdempotentRuns
    metrics: GatewayMetrics
    deadlines: DeadlineConfig
    ping_interval_s: float
    billing: Billing | None = None
    """The usage ledger; None when billing is switched off."""


async def get_services(http_request: HttpRequest) -> OpenAIServices:
    # async: FastAPI runs a plain `def` dependency in a thread pool, ~0.2 ms of CPU per request.
    services: OpenAIServices = http_request.app.state.openai
    return services


ServicesDep = Annotated[OpenAIServices, Depends(get_services)]


@router.post("/v1/chat/completions")
async def chat_completions(http_request: HttpRequest, services: ServicesDep) -> Response:
    """OpenAI chat completions, streaming or not."""
    return await _serve(Endpoint.CHAT, ChatCompletionRequest, http_request, services)


@router.post("/v1/completions")
async def completions(http_request: HttpRequest, services: ServicesDep) -> Response:
    """OpenAI (legacy) text completions, streaming or not."""
    return await _serve(Endpoint.COMPLETIONS, CompletionRequest, http_request, services)


@router.post("/v1/moderations")
async def moderations(http_request: HttpRequest, services: ServicesDep) -> dict[str, Any]:
    """OpenAI's moderation endpoint, answered by this gateway's providers: the caller's input
    policy's providers, or every configured one when its policy names none."""
    caller = await services.gate.authenticate(http_request.headers.get("authorization"))
    body = await _json_body(http_request)
    texts = parse_moderation_input(body)
    moderator = services.content.moderator
    providers = services.content.policy_for(caller.tenant).input.providers or tuple(
        sorted(moderator.provider_names)
    )
    results = await moderator.classify(texts, providers)
    model = body.get("model") or "tandem-moderation"
    return moderation_response(results, str(model), uuid.uuid4().hex)


@router.get("/v1/models")
async def list_models(http_request: HttpRequest, services: ServicesDep) -> dict[str, Any]:
    """The served models, in OpenAI's list shape (a key is needed, as on OpenAI)."""
    await services.gate.authenticate(http_request.headers.get("authorization"))
    return {
        "object": "list",
        "data": [
            {
                "id": model.name,
                "object": "model",
                "created": model.created,
                "owned_by": "tandem",
                "max_model_len": model.max_model_len,
                "default_max_tokens": model.output_cap,
            }
            for model in services.pipeline.models
        ],
    }


async def _serve(
    endpoint: Endpoint, schema: type[BaseModel], http_request: HttpRequest, services: OpenAIServices
) -> Response:
    """auth -> validate -> model -> moderate input -> idempotency -> admit -> run (docs/WIRE.md)."""
    headers = http_request.headers
    caller = await services.gate.authenticate(headers.get("authorization"))
    body = await _json_body(http_request)
    try:
        schema.model_validate(body)  # the client's own JSON is what the engine gets
    except ValidationError as exc:
        raise invalid_request_from_validation(exc) from exc
    model = services.pipeline.check_model(str(body["model"]))
    idempotency_key = parse_idempotency_key(headers.get(IDEMPOTENCY_HEADER))
    body_fingerprint = fingerprint(body) if idempotency_key else ""  # the client's own body
    request = Request(
        request_id=uuid.uuid4().hex,
        model=model.name,
        stream=bool(body.get("stream")),
        tenant_id=caller.tenant.tenant_id,
        key_id=caller.key.key_id if caller.key is not None else None,
        deadline=request_deadline(
            headers.get(TIMEOUT_HEADER), services.deadlines.default_s, services.deadlines.max_s
        ),
    )
    request.advance(RequestPhase.AUTHENTICATED)
    policy = services.content.policy_for(caller.tenant)
    body = await services.content.check_input(endpoint, body, request, policy)
    request.advance(RequestPhase.MODERATED)
    claim: IdempotentKey | None = None
    if idempotency_key is not None:
        outcome = await _claim(services, caller.tenant.tenant_id, endpoint, idempotency_key,
                             body_fingerprint, request)  # fmt: skip
        if isinstance(outcome, StoredResponse):
            services.metrics.observe_idempotency("replayed")
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return replay_response(outcome, endpoint, request.stream, include_usage)
        claim = outcome
        # Every run of this key is one ledger record: a re-run after a restart is not billed twice.
        request.record_id = idempotent_record_id(
            caller.tenant.tenant_id, endpoint.value, idempotency_key
        )
    try:
        services.pipeline.check_decode_available()
    except TandemError:
        if claim is not None:
            await services.idempotency.release(claim)
        raise
    # An idempotent request runs to the end whatever its client does: its retry gets it.
    assembler = StreamAssembler(endpoint) if claim is not None and request.stream else None
    recorder = None
    if services.billing is not None:
        recorder = UsageRecorder(services.billing, request, endpoint, model, body)
    execution = Execution(
        services.gate, services.pipeline, caller, endpoint, body, request, model,
        client_gone=None if claim is not None else _client_gone(http_request),
        output_filter=services.content.output_filter(endpoint, request, policy),
        on_chunk=assembler.add if assembler is not None else None,
        recorder=recorder,
    )  # fmt: skip
    if request.stream:
        source: StreamSource = execution
        if claim is not None and assembler is not None:
            source = services.idempotency.stream(claim, execution, assembler)
        return await serve_stream(source, services.ping_interval_s)
    if claim is not None:
        result = await services.idempotency.complete(claim, execution)
    else:
        result = await execution.complete()
    return Response(orjson.dumps(result), media_type="application/json", headers=execution.headers)


async def _claim(
    services: OpenAIServices,
    tenant_id: str,
    endpoint: Endpoint,
    key: str,
    body_fingerprint: str,
    request: Request,
) -> IdempotentKey | StoredResponse:
    try:
        claim = await services.idempotency.claim(
            tenant_id, endpoint, key, body_fingerprint, request
        )
    except TandemError as exc:
        services.metrics.observe_idempotency(exc.code or "error")
        raise
    if isinstance(claim, IdempotentKey):
        services.metrics.observe_idempotency("run")
    return claim


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
