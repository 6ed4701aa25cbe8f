"""``RawRoute`` (``gateway/serving/routes.py``): the hot routes served without FastAPI's
per-request machinery, with the same answers: the endpoint's response, the app's exception
handlers for its errors (before and after the body was read), and its place in the OpenAPI
document."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from core.errors import InvalidRequestError, RateLimitError
from gateway.errors import install_error_handlers
from gateway.serving.routes import RawRoute, router


def _app() -> FastAPI:
    raw = APIRouter()

    async def echo(http_request: HttpRequest) -> Response:
        body = await http_request.json()
        if body.get("refuse"):
            error = RateLimitError("Rate limit reached for tokens.", code="rate_limit_exceeded")
            error.extra_headers = {"x-request-id": "req-1"}
            raise error
        return JSONResponse({"echo": body, "path": http_request.url.path})

    async def broken(http_request: HttpRequest) -> Response:
        raise InvalidRequestError("A bad field.", param="model")

    raw.add_api_route("/echo", echo, methods=["POST"], route_class_override=RawRoute)
    raw.add_api_route("/broken", broken, methods=["POST"], route_class_override=RawRoute)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(raw)
    return app


async def _post(app: FastAPI, path: str, body: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
        return await client.post(path, json=body)


async def test_the_endpoint_answers_with_its_own_response() -> None:
    response = await _post(_app(), "/echo", {"a": 1})
    assert response.status_code == 200
    assert response.json() == {"echo": {"a": 1}, "path": "/echo"}


async def test_its_errors_get_the_apps_handlers_and_their_headers() -> None:
    refused = await _post(_app(), "/echo", {"refuse": True})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-request-id"] == "req-1"

    bad = await _post(_app(), "/broken", {})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "model"


async def test_a_wrong_method_is_still_routed_as_before() -> None:
    transport = httpx.ASGITransport(app=_app())
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
