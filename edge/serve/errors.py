"""Every failure as OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, with its
HTTP status: 400 invalid request (FastAPI's validation errors included), 401 missing or unknown API key,
404 unknown route or model, 413 body too large, 429 too many requests, 502 the cloud refused this
server's own credentials, 503 cloud unreachable, 500 anything else (an incident id; the traceback
goes to the server log only).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ...common.protocol.errors import (
    HybridSpecError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    incident,
)

log = logging.getLogger("hybridspec.edge.serve")

# OpenAI's `type` per status.
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         499: "client_closed_request", 500: "server_error", 502: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the client sees: status, message, the request field at fault, a machine-readable code;
    `extra` adds fields to the error object (e.g. the text generated before the cloud went away)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}

    def body(self) -> dict:
        """The JSON body (also sent as the `error` event of a stream)."""
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        """The HTTP response; a 429 or 503 says when to retry."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(exc: BaseException, during: str) -> APIError:
    """The client's view of an exception raised by the worker or the cloud."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidArgument, ValueError)):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, Unavailable):
        return APIError(503, str(exc), code="cloud_unavailable")
    if isinstance(exc, ResourceExhausted):  # the cloud's session, rate or context limits
        return APIError(429, str(exc), code="cloud_capacity")
    if isinstance(exc, (Unauthenticated, PermissionDenied)):  # this server's own credentials, not the client's
        return APIError(502, str(exc), code="cloud_refused_credentials")
    return APIError(500, str(incident(log, exc, during)), code="internal_error")


def install(app: FastAPI) -> None:
    """Answer every error with the OpenAI shape."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(HybridSpecError, _on_unexpected)
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


def validation_error(errors) -> APIError:
    """FastAPI's list of pydantic errors as one 400 naming the first bad field."""
    first = next(iter(errors), {"loc": (), "msg": "invalid request", "type": ""})
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                        code="invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object, sent with Content-Type: application/json",
                        code="invalid_body")
    path = loc[0] + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in loc[1:])
    return APIError(400, f"{path}: {first['msg']}", param=loc[0], code="invalid_value")


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()
    if exc.status_code == 405:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()
    return APIError(exc.status_code, str(exc.detail)).response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return api_error(exc, f"{request.method} {request.url.path}").response()
