"""configs/autoscale.yaml: Serve resolves its app-level policy to our planner, and the worker deployments
are autoscaled with Serve's delays off (no Ray cluster)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
from ray.serve.schema import ServeDeploySchema

from actors.config import WorkerConfig
from app.planner import PDPlanner
from app.planner_core import PlannerConfig
from app.serve_workers import ContextDeployment, GenerationDeployment, drain_leases

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "autoscale.yaml"


def application():
    return ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text())).applications[0]


def test_serve_builds_our_planner_from_the_config():
    policy = AutoscalingPolicy(**application().autoscaling_policy)  # imports and pickles it, as Serve does
    planner = _resolve_policy_callable(policy)
    assert isinstance(planner, PDPlanner)
    assert planner.config == PlannerConfig(**application().autoscaling_policy["policy_kwargs"])


def test_both_worker_deployments_are_autoscaled_without_serve_delays_within_the_budget():
    app = application()
    budget = app.autoscaling_policy["policy_kwargs"]["max_total_replicas"]
    configs = {d.name: AutoscalingConfig(**d.autoscaling_config) for d in app.deployments}
    assert set(configs) == {"ContextWorker", "GenerationWorker", "Ingress"}
    for name in ("ContextWorker", "GenerationWorker"):
        config = configs[name]
        assert (config.upscale_delay_s, config.downscale_delay_s) == (0, 0)
        assert config.min_replicas == 1 and config.max_replicas == budget - 1
    ingress = configs["Ingress"]  # only so that Serve samples its SLO stats: pinned at one replica
    assert ingress.min_replicas == ingress.initial_replicas == ingress.max_replicas == 1


def test_the_ingress_counts_requests_against_the_planners_slos():
    app = application()
    kwargs = app.autoscaling_policy["policy_kwargs"]
    assert (app.args["ttft_slo_s"], app.args["tpot_slo_s"]) == (kwargs["ttft_slo_s"], kwargs["tpot_slo_s"])


def test_the_worker_deployments_report_autoscaling_stats():
    for deployment in (ContextDeployment, GenerationDeployment):
        assert callable(getattr(deployment.func_or_class, "record_autoscaling_stats", None))


def test_removed_replicas_have_time_to_drain():
    timeouts = {d.name: d.graceful_shutdown_timeout_s for d in application().deployments}
    config = WorkerConfig()
    assert timeouts["ContextWorker"] > max(config.lease_s, config.claim_s) + 1.0
    assert timeouts["GenerationWorker"] >= 60


def test_a_draining_context_replica_waits_for_its_leases():
    leases = ["req-1", "req-2"]

    async def pull_them() -> None:
        for _ in range(2):
            await asyncio.sleep(0.05)
            leases.pop()

    async def scenario() -> tuple[bool, float]:
        puller = asyncio.ensure_future(pull_them())
        start = time.monotonic()
        drained = await drain_leases(leases, timeout_s=5.0, poll_s=0.01)
        await puller
        return drained, time.monotonic() - start

    drained, waited = asyncio.run(scenario())
    assert drained and not leases and 0.09 <= waited < 1.0
    assert not asyncio.run(drain_leases(["stuck"], timeout_s=0.05, poll_s=0.01))  # gives up at the timeout
