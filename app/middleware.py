"""Pure ASGI middleware: request metrics, API-key check, admission limit.

Pure ASGI rather than BaseHTTPMiddleware so that streamed replies pass
through untouched and "in flight" lasts until the last byte is sent (or the
client leaves). Order, outermost first: RequestMetrics ->
UnhandledError (app.errors) -> ApiKey -> Admission, so that rejected and
failed requests are counted too.

Why admission is here and not Serve's own ``max_queued_requests``. Tried on a
real Serve (Ray 2.60; one replica, ``max_ongoing_requests=1``,
``max_queued_requests=1``, four concurrent POSTs and a GET /health): two ran,
and Serve answered the rest with 503, but

- with a ``text/plain`` body ("Request dropped due to backpressure
  (num_queued_requests=1, max_queued_requests=1)."), not OpenAI's error JSON
  that SDKs and our clients read;
- with ``Retry-After`` only when ``backpressure_config.retry_after_s`` is set,
  an option of recent Rays only (none before it);
- for every route alike: the /health probe sent during the burst got the same
  503, so would a /metrics scrape;
- it bounds a queue in front of busy replicas, and cannot be 0 ("must be -1
  (no limit) or a positive integer"), so "turn away at once whatever is over
  N in flight" cannot be said with it.

Serve's limit is used where only it can act: the proxy's queue of requests
waiting for a free ingress replica, which never reach this middleware
(``app.serve_app.ingress_options``: bounded once ``max_queue`` is set).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import SERVER_ERROR, APIError
from app.metrics import ServingMetrics

UNMATCHED_ROUTE = "unmatched"


class RequestMetricsMiddleware:
    """Counts HTTP requests by route template and status."""

    def __init__(self, app: ASGIApp, *, metrics: ServingMetrics, known_paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before answering

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe_request(self._route_label(scope), status)

    def _route_label(self, scope: Scope) -> str:
        template = getattr(scope.get("route"), "path", None)
        if template:
            return template
        path = route_path(scope)
        return path if path in self.known_paths else UNMATCHED_ROUTE


class ApiKeyMiddleware:
    """401 for any ``/v1`` path without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_api_path(route_path(scope)) and not self._is_authorized(scope):
            error = APIError(
                401,
                "Invalid or missing API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.to_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _is_authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        return hmac.compare_digest(headers.get(b"authorization", b""), self.expected)


class AdmissionMiddleware:
    """503 + Retry-After once more than ``max_queue`` generation requests are in flight.

    ``max_queue=None`` admits everything; the in-flight gauge is kept either way.
    """

    def __init__(
        self, app: ASGIApp, *, metrics: ServingMetrics, paths: frozenset[str], max_queue: int | None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths
        self.max_queue = max_queue
        self.num_in_flight = 0

    def can_admit(self) -> bool:
        return self.max_queue is None or self.num_in_flight < self.max_queue

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        if not self.can_admit():
            await _overloaded_response()(scope, receive, send)
            return
        self.num_in_flight += 1
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1
            self.metrics.in_flight.dec()


def route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve may mount it under a prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _overloaded_response() -> JSONResponse:
    error = APIError(
        503,
        "The server is overloaded; retry later",
        type=SERVER_ERROR,
        code="overloaded",
        headers={"Retry-After": "1"},
    )
    return error.to_response()
