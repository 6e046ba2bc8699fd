"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure leaves the app in this shape with a fitting status: schema
violations and undecodable bodies are 400 (never FastAPI's 422), unknown
routes 404, anything unexpected a generic 500 whose details go to the log,
never to the client.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error the client should see, with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    message = f"The model `{model}` does not exist."
    return APIError(404, message, param="model", code="model_not_found")


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    """The first schema violation, named by its top-level body field."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request("Request body is not valid JSON")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    error = (first.get("ctx") or {}).get("error")
    param = loc[0] if loc else getattr(error, "param", None)  # a whole-body check names its field itself
    message = str(error) if first.get("type") == "value_error" and error else first.get("msg", "")
    return bad_request(f"{param}: {message}" if param else message, param=param)


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return exc.to_response()


async def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_to_api_error(exc).to_response()


async def _http_exception_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
        error = APIError(404, message, code="not_found")
    else:
        error_type = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        error = APIError(exc.status_code, str(exc.detail), type=error_type, headers=exc.headers)
    return error.to_response()


def _internal_error_response() -> JSONResponse:
    return JSONResponse(error_body("Internal server error", SERVER_ERROR), status_code=500)


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _internal_error_response()


class UnhandledErrorMiddleware:
    """Answers an unexpected exception with a generic 500 and logs it.

    Starlette's own last-resort handler re-raises into the server, which
    then drops the keep-alive connection under the client's next request;
    this one swallows the exception once it is logged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_started = False

        async def send_tracking(message: Message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except ClientDisconnect:
            pass  # the client left; nobody is there to answer
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if scope["type"] == "http" and not is_started:
                await _internal_error_response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
