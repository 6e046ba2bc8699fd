"""The worker deployments' health-check options (no Ray): one default, and cluster.yaml states the same.

A killed replica is noticed at the controller's next health check of it, so the
period bounds detection (test_serve_faults measures the whole replacement).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from app.serve_workers import (
    HEALTH_CHECK_PERIOD_S,
    HEALTH_CHECK_TIMEOUT_S,
    AggregatedDeployment,
    ContextDeployment,
    GenerationDeployment,
)

ROOT = Path(__file__).resolve().parents[2]
WORKERS = (ContextDeployment, GenerationDeployment, AggregatedDeployment)


def test_every_worker_deployment_is_health_checked_every_second():
    for deployment in WORKERS:
        config = deployment._deployment_config  # Serve exposes no public getter for these two
        assert (config.health_check_period_s, config.health_check_timeout_s) == (1.0, 10.0), deployment.name
    assert HEALTH_CHECK_PERIOD_S < HEALTH_CHECK_TIMEOUT_S  # a slow answer is not cut off by the next check


def test_cluster_config_states_the_same_health_checks():
    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text()))
    workers = [d for d in schema.applications[0].deployments if d.name in {w.name for w in WORKERS}]
    assert {d.name for d in workers} == {"ContextWorker", "GenerationWorker"}
    for deployment in workers:
        assert (deployment.health_check_period_s, deployment.health_check_timeout_s) == (
            HEALTH_CHECK_PERIOD_S, HEALTH_CHECK_TIMEOUT_S), deployment.name
