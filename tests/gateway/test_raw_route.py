"""``RawRoute`` and ``HotRoutes`` (``gateway/serving/routes.py``): the hot routes served
without FastAPI's per-request machinery, and with ``HotRoutes`` past the framework's layers
too, with the same answers: the endpoint's response, the app's exception handlers for its
errors (before and after the body was read, and a bug as the catch-all's 500), and its place
in the OpenAPI document."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.routing import Router

from core.errors import InvalidRequestError, RateLimitError
from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.app import GatewayConfig, create_app
from gateway.client_address import ClientAddress
from gateway.errors import install_error_handlers
from gateway.serving.routes import HotRoutes, RawRoute, router
from gateway.serving.upstream import UpstreamConfig
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

SCOPES: list[dict[str, Any]] = []
"""The scope each request reached its endpoint with."""


class _Teapot(Exception):
    """Answered by a plain (not async) handler, as starlette allows."""


def _app(hot: bool = False) -> FastAPI:
    raw = APIRouter()

    async def echo(http_request: HttpRequest) -> Response:
        SCOPES.append(dict(http_request.scope))
        body = await http_request.json()
        if body.get("refuse"):
            error = RateLimitError("Rate limit reached for tokens.", code="rate_limit_exceeded")
            error.extra_headers = {"x-request-id": "req-1"}
            raise error
        return JSONResponse({"echo": body, "path": http_request.url.path})

    async def broken(http_request: HttpRequest) -> Response:
        raise InvalidRequestError("A bad field.", param="model")

    async def buggy(http_request: HttpRequest) -> Response:
        raise KeyError("a bug")

    async def teapot(http_request: HttpRequest) -> Response:
        raise _Teapot()

    raw.add_api_route("/echo", echo, methods=["POST"], route_class_override=RawRoute)
    raw.add_api_route("/broken", broken, methods=["POST"], route_class_override=RawRoute)
    raw.add_api_route("/buggy", buggy, methods=["POST"], route_class_override=RawRoute)
    raw.add_api_route("/teapot", teapot, methods=["POST"], route_class_override=RawRoute)
    app = FastAPI()
    install_error_handlers(app)
    app.add_exception_handler(_Teapot, lambda _request, _exc: Response(status_code=418))
    app.include_router(raw)
    if hot:
        app.add_middleware(HotRoutes, router=app.router)
    return app


async def _post(app: FastAPI, path: str, body: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
        return await client.post(path, json=body)


@pytest.mark.parametrize("hot", [False, True], ids=["routed", "hot"])
async def test_the_endpoint_answers_with_its_own_response(hot: bool) -> None:
    response = await _post(_app(hot), "/echo", {"a": 1})
    assert response.status_code == 200
    assert response.json() == {"echo": {"a": 1}, "path": "/echo"}
    assert SCOPES[-1]["route"].path == "/echo"  # as the router would have set it


@pytest.mark.parametrize("hot", [False, True], ids=["routed", "hot"])
async def test_its_errors_get_the_apps_handlers_and_their_headers(hot: bool) -> None:
    refused = await _post(_app(hot), "/echo", {"refuse": True})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-request-id"] == "req-1"

    bad = await _post(_app(hot), "/broken", {})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "model"

    assert (await _post(_app(hot), "/teapot", {})).status_code == 418


@pytest.mark.parametrize("hot", [False, True], ids=["routed", "hot"])
async def test_a_bug_is_the_catch_alls_500(hot: bool) -> None:
    transport = httpx.ASGITransport(app=_app(hot), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
        response = await client.post("/buggy", json={})
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("The gateway hit an internal error")


async def test_hot_routes_skip_the_frameworks_layers_and_nothing_else() -> None:
    await _post(_app(hot=True), "/echo", {})
    assert "fastapi_middleware_astack" not in SCOPES[-1]  # FastAPI's exit stack: not passed
    await _post(_app(hot=False), "/echo", {})
    assert "fastapi_middleware_astack" in SCOPES[-1]

    transport = httpx.ASGITransport(app=_app(hot=True), root_path="/under")
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
        answer = await client.post("/under/echo", json={"b": 2})
        not_raw = await client.post("/under/nowhere", json={})
    assert answer.json()["echo"] == {"b": 2}  # a root path: routed, as before
    assert "fastapi_middleware_astack" in SCOPES[-1]
    assert not_raw.status_code == 404


def test_hot_routes_refuse_a_route_with_path_parameters() -> None:
    async def item(http_request: HttpRequest) -> Response:
        return Response()

    with_params = APIRouter()
    with_params.add_api_route(
        "/items/{item}", item, methods=["POST"], route_class_override=RawRoute
    )
    with pytest.raises(ValueError, match="exactly"):
        HotRoutes(Router(), router=with_params)


def test_the_gateway_serves_its_hot_routes_innermost() -> None:
    pools = [
        WorkerPool(PoolConfig(role, external_urls=("http://127.0.0.1:9",)))
        for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
    ]
    deployment = Deployment(ServedModel("m", 256, 0), pools[0], pools[1])
    app = create_app(GatewayConfig(upstream=UpstreamConfig()), Deployments([deployment]))
    layers: list[object] = [middleware.cls for middleware in app.user_middleware]
    # Inside ClientAddress: the route reads the client's address it sets.
    assert layers[-2:] == [ClientAddress, HotRoutes]


@pytest.mark.parametrize("hot", [False, True], ids=["routed", "hot"])
async def test_a_wrong_method_is_still_routed_as_before(hot: bool) -> None:
    transport = httpx.ASGITransport(app=_app(hot))
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
        response = await client.get("/echo")
    assert response.status_code == 405


def test_the_hot_routes_are_raw_and_documented() -> None:
    hot = {route.path for route in router.routes if isinstance(route, RawRoute)}
    assert hot == {"/v1/chat/completions", "/v1/completions"}
    app = FastAPI()
    app.include_router(router)
    paths = app.openapi()["paths"]
    assert {"/v1/chat/completions", "/v1/completions"} <= set(paths)
    assert type(next(r for r in app.routes if getattr(r, "path", "") == "/v1/completions")) is (
        RawRoute
    )
