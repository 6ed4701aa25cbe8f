"""Rendering every error as OpenAI's ``{"error": {...}}`` body: the only place that does it."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from core.errors import InvalidRequestError, TandemError

log = logging.getLogger("tandem.gateway")

_HTTP_STATUS_TYPES = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
}


def error_response(exc: TandemError) -> Response:
    """The HTTP response for a Tandem error, with its retry hints as headers."""
    return Response(
        orjson.dumps(exc.to_body()),
        status_code=exc.status_code,
        media_type="application/json",
        headers=exc.headers(),
    )


def invalid_request_from_validation(exc: ValidationError | RequestValidationError) -> TandemError:
    """A 400 naming the first offending field, as OpenAI does (``param`` is its dotted path)."""
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid value"))
    where = f"'{param}'" if param else "the request body"
    return InvalidRequestError(f"Invalid value for {where}: {message}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Make every failure, including framework ones, leave as an OpenAI error body."""

    async def on_tandem_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, TandemError)  # registered for TandemError only
        return error_response(exc)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(invalid_request_from_validation(exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error_type, code = _HTTP_STATUS_TYPES.get(exc.status_code, ("api_error", None))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette's Allow names the first route on the path only; HTTP wants them all.
            headers["Allow"] = ", ".join(_allowed_methods(request))
        error = TandemError(
            f"{request.method} {request.url.path}: {exc.detail}", code=code, extra_headers=headers
        )
        error.status_code, error.error_type = exc.status_code, error_type
        return error_response(error)

    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        # The one catch-all: a bug must still answer in OpenAI's shape, and be logged in full.
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(TandemError("The gateway hit an internal error; it was logged."))

    app.add_exception_handler(TandemError, on_tandem_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves on the request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)
