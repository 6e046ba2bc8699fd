"""The Serve application: ``build_app(args)`` for ``import_path: app.serve_app:build_app``.

    Ingress (FastAPI, app.api) ──► ContextWorker ──► GenerationWorker     mode: disagg
                               └─► AggregatedWorker                       mode: aggregated
    Ingress running the engine itself (EngineIngress)                     mode: aggregated, engine_in_ingress
    every worker replica ──(its stats, every REPORT_PERIOD_S)──► WorkerStats ◄── GET /metrics

The worker deployments and the stats board are app.serve_workers'; here are the
ingress (the OpenAI API over the workers' handles, app.serve_backend; or over its
own engine, app.local_backend) and the builder that binds them from one ``AppConfig``.
"""

from __future__ import annotations

import inspect

from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import build_api
from app.config import AppConfig
from app.local_backend import LocalBackend
from app.placement import PromptHasher
from app.planner_stats import IngressStats
from app.serve_backend import ServeBackend
from app.serve_workers import (
    WORKER_OPTIONS,
    AggregatedDeployment,
    AggregatedReplica,
    ContextDeployment,
    GenerationDeployment,
    WorkerReplica,
    WorkerStats,
)
from engine.model_registry import resolve_model_path
from engine.tokenizer import Tokenizer

INGRESS_MAX_ONGOING_REQUESTS = 1024  # app.config's max_queue is the admission limit (app.middleware)
# With max_queue set, Serve's own limit bounds the proxy's queue in front of a full ingress replica,
# which the middleware cannot see; generous, so that the middleware's OpenAI-shaped 503 comes first.
INGRESS_MAX_QUEUED_REQUESTS = 1024
# Serve's controller and proxy, started with these (serve.start(controller_options=...) or a config's top-level
# ``controller_options``; the proxy inherits the controller's environment):
# - RAY_SERVE_PROXY_USE_GRPC: the proxy sends each request to the ingress, and gets its streamed response
#   back, over gRPC (one gRPC stream per request, not a Ray object per chunk: the proxy's CPU per token
#   1.4 -> 0.8-1.0 ms, docs/benchmarks.md). The ingress's own calls to the workers follow AppConfig.handle_transport.
# - RAY_SERVE_CONTROL_LOOP_INTERVAL_S: the controller's loop every 0.5 s, not 0.1: its idle CPU 44 -> 18-21
#   ms a second, on the cores the engines use (served ITL at c = 1 7-17% lower in alternating runs,
#   docs/benchmarks.md). Replica state changes (a dead replica's replacement included) advance once a loop.
SERVE_CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": {"RAY_SERVE_PROXY_USE_GRPC": "1",
                                                         "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}}}


def start_serve(port: int) -> None:
    """Serve started in process as ``serve run`` starts it from configs/*.yaml: HTTP on 127.0.0.1:port,
    its controller (and proxy) with SERVE_CONTROLLER_OPTIONS. For tests and benchmarks."""
    serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=SERVE_CONTROLLER_OPTIONS)


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
@serve.ingress()
class Ingress:
    """The OpenAI HTTP API (app.api) over the worker deployments' handles."""

    def __init__(self, config: AppConfig, board: DeploymentHandle, **workers: DeploymentHandle) -> None:
        model_path = resolve_model_path(config.model)
        self.config = config
        self.tokenizer = Tokenizer(model_path)
        max_model_len = config.serving_max_model_len(model_path)
        by_reference = config.handle_transport == "ray"
        self.workers = {role: handle.options(_by_reference=by_reference) for role, handle in workers.items()}
        self.backend = ServeBackend(model_name=config.served_model, max_model_len=max_model_len, board=board,
                                    hasher=PromptHasher(config, model_path),
                                    local_prefill_max_tokens=config.local_prefill_max_tokens, **self.workers)
        self.slo_window = IngressStats(config.ttft_slo_s, config.tpot_slo_s)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """End-to-end TTFT / TPOT percentiles and SLO counts for the P:D planner (app.planner_stats);
        Serve samples it only where the ingress has an autoscaling_config (configs/autoscale.yaml)."""
        return self.slo_window.report()

    async def request_paths(self) -> dict[str, str]:
        """Each recent request's path through this ingress (app.serve_backend), for fault tests."""
        return dict(self.backend.paths)

    async def worker_transports(self) -> dict[str, str]:
        """How the calls to each worker deployment travel: "grpc" or "ray" (AppConfig.handle_transport)."""
        return {role: "ray" if handle.handle_options._by_reference else "grpc" for role, handle in self.workers.items()}

    def __serve_build_asgi_app__(self):
        return ingress_api(self.backend, self.tokenizer, self.config, self.slo_window)


# The engine's replica: Serve's health checks every second, as for the worker deployments (a dead engine
# is replaced as soon); the worker deployments' KV-aware router has nothing to choose here.
ENGINE_INGRESS_OPTIONS = {key: value for key, value in WORKER_OPTIONS.items() if key != "request_router_config"}


@serve.deployment(name="Ingress", max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, **ENGINE_INGRESS_OPTIONS)
@serve.ingress()
class EngineIngress(AggregatedReplica):
    """The OpenAI HTTP API over an aggregated engine in this replica (``engine_in_ingress``): a token goes
    from the engine loop to the SSE response in process, with no Serve stream between worker and ingress.
    Also a worker replica (app.serve_workers.AggregatedReplica): stats to the board, ``abort``, ``ping``."""

    async def __init__(self, config: AppConfig, board: DeploymentHandle) -> None:
        model_path = resolve_model_path(config.model)
        self.config = config
        self.tokenizer = Tokenizer(model_path)
        max_model_len = config.serving_max_model_len(model_path)
        await super().__init__(config.to_worker_config(), board)
        self.backend = LocalBackend(self, model_name=config.served_model, max_model_len=max_model_len, board=board)

    def __serve_build_asgi_app__(self):
        return ingress_api(self.backend, self.tokenizer, self.config)

    async def __del__(self) -> None:
        """The worker's shutdown (WorkerReplica's), then the ASGI wrapper's (Serve's, next in the MRO)."""
        await WorkerReplica.__del__(self)
        parent = getattr(super(WorkerReplica, self), "__del__", None)
        result = parent() if parent is not None else None
        if inspect.isawaitable(result):
            await result


def ingress_api(backend, tokenizer: Tokenizer, config: AppConfig, slo_window: IngressStats | None = None) -> ASGIApp:
    """app.api's FastAPI app as an ingress replica serves it."""
    api = build_api(backend, tokenizer, api_key=config.api_key, max_queue=config.max_queue, slo_window=slo_window)
    api.add_middleware(ServeDisconnectMiddleware)
    return api


class ServeDisconnectMiddleware:
    """Turns Serve's way of saying "the client left" into ASGI's.

    Once the proxy cancels a request (its client disconnected), ``receive()``
    raises TaskCancelledError in the replica; app.api waits for an
    ``http.disconnect`` message to stop and abort the request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


def build_app(args: dict) -> serve.Application:
    """The application of one ``AppConfig`` (``args``: its fields; ValueError if invalid).

    Serve calls it with the config's ``args`` and refuses a builder of more than one
    parameter, so options of the worker deployments come from the config's
    ``deployments:`` list there, and from ``build_app_with`` in process.
    """
    return build_app_with(args)


def build_app_with(args: dict | None = None, worker_options: dict[str, dict] | None = None) -> serve.Application:
    """``build_app`` plus ``worker_options``: Serve options by worker deployment name
    (``{"ContextWorker": {"num_replicas": 2}}``), for tests and benchmarks that serve in process; none
    applies with ``engine_in_ingress`` (no worker deployment)."""
    config = AppConfig.model_validate(args or {})
    if config.engine_in_ingress:
        return EngineIngress.options(**ingress_options(config)).bind(config, WorkerStats.bind())
    max_ongoing = max(8, 2 * config.max_num_seqs)
    board = WorkerStats.bind()

    def worker(deployment, role: str | None = None):
        options = {"max_ongoing_requests": max_ongoing, **(worker_options or {}).get(deployment.name, {})}
        return deployment.options(**options).bind(config.to_worker_config(role), board)

    if config.mode == "disagg":
        workers = {"context": worker(ContextDeployment, "context"),
                   "generation": worker(GenerationDeployment, "generation")}
    else:
        workers = {"aggregated": worker(AggregatedDeployment)}
    return Ingress.options(**ingress_options(config)).bind(config, board, **workers)


def ingress_options(config: AppConfig) -> dict:
    """Serve options of the ingress that follow from the config (a Serve config's
    ``deployments:`` entry still overrides them): the proxy's queue is bounded once
    ``max_queue`` asks for admission control, and left unbounded (Serve's -1) otherwise."""
    if config.max_queue is None:
        return {}
    return {"max_queued_requests": INGRESS_MAX_QUEUED_REQUESTS}
