"""The OpenAI-compatible HTTP API, built over any Backend (Ray-free).

``build_api(backend, tokenizer)`` (app.backend's protocols) returns a FastAPI app with::

    GET  /v1/models, /v1/models/{model}
    POST /v1/completions, /v1/chat/completions   (JSON, or SSE with "stream": true)
    GET  /health                                 (200, or 503 if check_health raises)
    GET  /metrics                                (Prometheus text, this app's registry only)

The Serve ingress mounts this app and implements Backend with Serve handles;
tests implement it in-process. Errors leave in OpenAI's shape (app.errors).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from app import routes_chat, routes_completions
from app.backend import Backend, ServingTokenizer
from app.errors import SERVER_ERROR, UnhandledErrorMiddleware, error_body, install_error_handlers
from app.generation import ServingContext, grammar_compiler_for
from app.metrics import ServingMetrics
from app.middleware import AdmissionMiddleware, ApiKeyMiddleware, RequestMetricsMiddleware
from app.planner_stats import IngressStats

logger = logging.getLogger(__name__)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Labels for requests rejected before routing; routed ones are labelled by their template.
KNOWN_PATHS = GENERATION_PATHS | {"/health", "/metrics", "/v1/models"}


def build_api(
    backend: Backend, tokenizer: ServingTokenizer, *, api_key: str | None = None, max_queue: int | None = None,
    slo_window: IngressStats | None = None,
) -> FastAPI:
    """A new app with its own metrics registry; see the module docstring.

    ``api_key``: required as ``Authorization: Bearer`` on every ``/v1`` route.
    ``max_queue``: at most this many generation requests in flight; more get 503.
    ``slo_window``: gets every finished request's TTFT and TPOT (the P:D planner's ingress stats).
    """
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be non-empty (None turns the check off)")
    metrics = ServingMetrics(slo_window)
    app = FastAPI(title="windserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = ServingContext(backend=backend, tokenizer=tokenizer, metrics=metrics,
                                       grammars=grammar_compiler_for(tokenizer))
    for router in (_service_router(), routes_completions.router, routes_chat.router):
        app.include_router(router)
    install_error_handlers(app)
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(AdmissionMiddleware, metrics=metrics, paths=GENERATION_PATHS, max_queue=max_queue)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(UnhandledErrorMiddleware)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, known_paths=KNOWN_PATHS)
    return app


def _service_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", _health, methods=["GET"])
    router.add_api_route("/metrics", _metrics, methods=["GET"])
    router.add_api_route("/v1/models", _list_models, methods=["GET"])
    router.add_api_route("/v1/models/{model:path}", _retrieve_model, methods=["GET"])
    return router


def _serving(request: Request) -> ServingContext:
    return request.app.state.serving


def _model_card(ctx: ServingContext) -> dict:
    return {
        "id": ctx.backend.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "windserve",
        "max_model_len": ctx.backend.max_model_len,
    }


async def _list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(_serving(request))]}


async def _retrieve_model(model: str, request: Request) -> dict:
    ctx = _serving(request)
    ctx.check_model(model)
    return _model_card(ctx)


async def _health(request: Request) -> Response:
    try:
        await _serving(request).backend.check_health()
    except Exception as exc:
        logger.warning("health check failed: %s", exc)
        body = error_body("Backend is unhealthy", SERVER_ERROR, code="unhealthy")
        return JSONResponse(body, status_code=503)
    return Response(status_code=200)


async def _metrics(request: Request) -> Response:
    ctx = _serving(request)
    try:
        stats = await ctx.backend.stats()
    except Exception:
        logger.exception("backend.stats() failed; worker series left out of this scrape")
        stats = None
    return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE_PLAIN_0_0_4)
