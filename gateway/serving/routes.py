"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/v1/moderations``. A route parses, runs the flow (``gateway/serving/flow.py``), renders."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.routing import Router
from starlette.types import ASGIApp, Receive, Scope, Send

from admission.idempotency import HEADER as IDEMPOTENCY_HEADER
from admission.idempotency import fingerprint, parse_idempotency_key
from core.errors import InvalidRequestError
from core.messages import Endpoint
from core.models import ServedModel
from gateway.errors import handled_response, invalid_request_from_validation
from gateway.serving.deadlines import TIMEOUT_HEADER, request_deadline
from gateway.serving.flow import Answered, Outcome, Replayed, RequestFlow, ServingServices
from gateway.serving.hangup import client_gone_of
from gateway.serving.idempotent import replay_response
from gateway.serving.schemas import ChatCompletionRequest, CompletionRequest, validate_request
from gateway.serving.sse import serve_stream
from moderation.openai_shape import moderation_response, parse_moderation_input
from telemetry.request_trace import operation_name

SESSION_HEADER = "x-tandem-session"
"""A client's sticky-assignment subject, when ``user`` / ``safety_identifier`` do not fit."""

router = APIRouter()

SERVING_STATE = "serving"
"""The lifespan state key the app's assembly puts this package's ``ServingServices`` under."""


def serving_services(http_request: HttpRequest) -> ServingServices:
    """This package's services, from the app's lifespan state."""
    services: ServingServices = getattr(http_request.state, SERVING_STATE)
    return services


async def get_services(http_request: HttpRequest) -> ServingServices:
    # async: FastAPI runs a plain `def` dependency in a thread pool, ~0.2 ms of CPU per request.
    return serving_services(http_request)


ServicesDep = Annotated[ServingServices, Depends(get_services)]


class RawRoute(APIRoute):
    """A route whose endpoint takes the raw request and returns its response, served without
    FastAPI's per-request machinery: no dependency resolution, no exit stacks, no route-level
    exception wrapper around the response and each of its sends. The app's exception handlers
    answer the endpoint's errors (``gateway.errors.handled_response``: the app's
    ``ExceptionMiddleware`` would, but ``HotRoutes`` may bring the request here past it), and
    it stays an ``APIRoute``: matched in its place, and in the OpenAPI document as before.

    For the two hot routes: from the head parsed to the route's entry went from 0.37 to 0.27
    ms at one stream (``bench.overhead.ttft_steps``), and each open stream holds 6 KiB less."""

    def __init__(
        self, path: str, endpoint: Callable[[HttpRequest], Awaitable[Response]], **kwargs: Any
    ) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.app = _raw_app(endpoint)


def _raw_app(endpoint: Callable[[HttpRequest], Awaitable[Response]]) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await endpoint(HttpRequest(scope, receive, send))
        except Exception as exc:
            if (handled := await handled_response(exc, scope, receive)) is None:
                raise
            response = handled
        await response(scope, receive, send)

    return app


class HotRoutes:
    """ASGI middleware, the app's innermost: a ``POST`` to one of the router's ``RawRoute``s
    goes straight to it, past the layers starlette and FastAPI put under the app's own
    middleware. Those layers do nothing a raw route uses: the exception middleware's handlers
    are the route's own (``gateway.errors.handled_response``), FastAPI's exit stack is for
    files uploaded to its other routes, and the router would find the same route. Each layer
    cost every request a coroutine, and the exception middleware a ``Request`` and a wrapper
    around every send: 32.5 -> 29.2 KiB of objects held per open stream
    (``bench.overhead.memory_sites``), 59.2 -> 55.5 KiB of RSS a stream at 512 streams, and
    0.16 -> 0.13 ms from the head parsed to the route's entry at one stream
    (``bench.overhead.ttft_steps``; three runs alternated).

    The scope gets what the router would have put in it (the route, its endpoint, no path
    parameters). Anything else (another method, a path under a ``root_path``, every other
    route) goes through the app as before."""

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self._routes: dict[str, tuple[ASGIApp, dict[str, Any]]] = {}
        for route in router.routes:
            if isinstance(route, RawRoute) and "POST" in (route.methods or ()):
                if route.param_convertors:
                    raise ValueError(f"HotRoutes matches paths exactly, not {route.path}")
                routed = {"route": route, "endpoint": route.endpoint, "path_params": {}}
                self._routes[route.path] = (route.app, routed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            hot = self._routes.get(scope["path"])
            if hot is not None:
                route_app, routed = hot
                scope.update(routed)
                await route_app(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def chat_completions(http_request: HttpRequest) -> Response:
    """OpenAI chat completions, streaming or not."""
    # The services are read here, not injected: a dependency costs FastAPI a resolution per
    # request, and these two routes are the hot path.
    services = serving_services(http_request)
    return await _serve(Endpoint.CHAT, ChatCompletionRequest, http_request, services)


async def completions(http_request: HttpRequest) -> Response:
    """OpenAI (legacy) text completions, streaming or not."""
    services = serving_services(http_request)
    return await _serve(Endpoint.COMPLETIONS, CompletionRequest, http_request, services)


router.add_api_route(
    "/v1/chat/completions", chat_completions, methods=["POST"], route_class_override=RawRoute
)
router.add_api_route(
    "/v1/completions", completions, methods=["POST"], route_class_override=RawRoute
)


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
async def list_models(
    http_request: HttpRequest, services: ServicesDep, include_versions: bool = False
) -> dict[str, Any]:
    """The aliases served, in OpenAI's list shape (a key is needed, as on OpenAI); with
    ``?include_versions=true`` each deployed version too (``"version_of"`` names its alias),
    where clients may name versions directly."""
    await services.gate.authenticate(http_request.headers.get("authorization"))
    catalog = services.catalog
    deployments = catalog.deployments
    data = []
    for alias in deployments.aliases():
        of_alias = deployments.of_alias(alias)
        data.append(_model_entry(alias, of_alias[0].model))
        policy = catalog.policy(alias)
        if include_versions and (policy is None or policy.direct_access):
            data += [
                {**_model_entry(d.version, d.model), "version_of": alias}
                for d in of_alias
                if d.version != alias
            ]
    return {"object": "list", "data": data}


def _model_entry(model_id: str, model: ServedModel) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": model.created,
        "owned_by": "tandem",
        "max_model_len": model.max_model_len,
        "default_max_tokens": model.output_cap,
    }


async def _serve(
    endpoint: Endpoint,
    schema: type[ChatCompletionRequest | CompletionRequest],
    http_request: HttpRequest,
    services: ServingServices,
) -> Response:
    """auth -> validate -> the flow -> the response (docs/WIRE.md). The request's trace
    starts here, under the client's ``traceparent``; the flow ends it once the request ran,
    this function when it ended before (refused, or replayed)."""
    headers = http_request.headers
    trace = services.tracing.start(headers, operation_name(endpoint))
    try:
        with trace.span("tandem.authenticate"):
            caller = await services.gate.authenticate(headers.get("authorization"))
        body = await _json_body(http_request)
        try:
            validate_request(schema, body)  # the client's own JSON is what the engine gets
        except ValidationError as exc:
            raise invalid_request_from_validation(exc) from exc
        flow = RequestFlow(services)
        deadline = request_deadline(
            headers.get(TIMEOUT_HEADER), services.deadlines.default_s, services.deadlines.max_s
        )
        idempotency_key = parse_idempotency_key(headers.get(IDEMPOTENCY_HEADER))
        # The client's own body, before its version is resolved and its defaults filled in: a
        # retry drawn to another version is still the same request.
        body_fingerprint = fingerprint(body) if idempotency_key else ""
        request = flow.receive(endpoint, body, caller, deadline, headers.get(SESSION_HEADER))
        trace.received(request)
        client_gone = client_gone_of(http_request.scope, http_request.receive)
        outcome = await flow.serve(
            request, caller, idempotency_key, body_fingerprint, client_gone, trace
        )
    except BaseException as exc:
        trace.end(error=exc)
        raise
    if isinstance(outcome, Replayed):
        trace.end()
    return _render(outcome, request.stream, request.include_usage, endpoint, services)


def _render(
    outcome: Outcome,
    stream: bool,
    include_usage: bool,
    endpoint: Endpoint,
    services: ServingServices,
) -> Response:
    if isinstance(outcome, Replayed):
        return replay_response(outcome.stored, endpoint, stream, include_usage)
    if isinstance(outcome, Answered):
        return Response(
            orjson.dumps(outcome.body), media_type="application/json", headers=outcome.headers
        )
    return serve_stream(outcome.source, services.ping_interval_s)


async def _json_body(http_request: HttpRequest) -> dict[str, Any]:
    # Read as a stream: body() would keep the bytes on the request for as long as the
    # response streams (the parsed prompt is what the request keeps).
    chunks = [chunk async for chunk in http_request.stream() if chunk]
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    del chunks
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
