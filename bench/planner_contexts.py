"""Serve's own ``AutoscalingContext`` objects, built outside Serve, for the planner's simulator and tests.

The planner (app.planner) reads a context's deployment name and id, replica counts (running,
target), running replica ids, current time and ``aggregated_metrics`` (key -> replica id -> value).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

APP = "windserve"


class RoleView(NamedTuple):
    """One deployment as the controller sees it at an instant."""

    name: str
    target: int
    replicas: tuple[str, ...]  # the running replicas' ids
    metrics: dict[str, dict[str, float]]  # key -> replica id -> value


def replica_id(deployment: str, unique_id: str) -> ReplicaID:
    return ReplicaID(unique_id, DeploymentID(deployment, APP))


@cache  # pydantic's validation costs a millisecond; the simulator asks every second
def autoscaling_config(max_replicas: int) -> AutoscalingConfig:
    """What configs/autoscale.yaml gives each worker deployment: delays 0, bounds 1..max."""
    return AutoscalingConfig(min_replicas=1, max_replicas=max_replicas, upscale_delay_s=0, downscale_delay_s=0)


def build_context(view: RoleView, now: float, max_replicas: int = 8) -> AutoscalingContext:
    dep = DeploymentID(view.name, APP)
    ids = {r: ReplicaID(r, dep) for r in view.replicas}
    metrics = {key: {ids[r]: v for r, v in values.items() if r in ids} for key, values in view.metrics.items()}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=view.name, app_name=APP, current_num_replicas=len(view.replicas),
        target_num_replicas=view.target, running_replicas=list(ids.values()), total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=max_replicas, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=autoscaling_config(max_replicas))


def build_contexts(views: list[RoleView], now: float, max_replicas: int = 8) -> dict:
    contexts = (build_context(view, now, max_replicas) for view in views)
    return {ctx.deployment_id: ctx for ctx in contexts}


def by_name(decisions: dict) -> dict[str, int]:
    return {dep_id.name: num for dep_id, num in decisions.items()}
