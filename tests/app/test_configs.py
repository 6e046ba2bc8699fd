"""configs/*.yaml and docker-compose.yml agree with Serve's schema, AppConfig and each other (no Ray, no Docker)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from actors.config import WorkerConfig
from app.config import API_KEY_ENV, AppConfig
from app.serve_app import (
    AggregatedDeployment, ContextDeployment, GenerationDeployment, Ingress, WorkerStats, build_app,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DEPLOYMENTS = {
    "disagg": {d.name for d in (Ingress, WorkerStats, ContextDeployment, GenerationDeployment)},
    "aggregated": {d.name for d in (Ingress, WorkerStats, AggregatedDeployment)},
}


def serve_config(path: Path) -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))


def test_the_three_configs_exist():
    assert {p.name for p in CONFIGS} >= {"disagg.yaml", "aggregated.yaml", "cluster.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_through_serve_and_app_config(path):
    for app in serve_config(path).applications:
        assert app.import_path == "app.serve_app:build_app"
        config = AppConfig.model_validate(app.args)
        build_app(app.args)  # binds the deployment graph; starts nothing
        unknown = {d.name for d in app.deployments} - DEPLOYMENTS[config.mode]
        assert not unknown, f"{path.name} overrides deployments the app does not have: {unknown}"


def test_local_configs_serve_on_loopback():
    for name in ("disagg.yaml", "aggregated.yaml"):
        config = serve_config(ROOT / "configs" / name)
        assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)
    assert AppConfig.model_validate(serve_config(ROOT / "configs" / "disagg.yaml").applications[0].args).mode == "disagg"


def shell_words(command: str) -> list[str]:
    """A command's words, with a ``bash -c "..."`` script split too."""
    words = shlex.split(command)
    return shell_words(words[2]) if words[:2] == ["bash", "-c"] else words


def compose_commands() -> dict[str, list[str]]:
    return {name: shell_words(service["command"]) for name, service in COMPOSE["services"].items()}


def test_compose_names_only_paths_that_exist():
    services = COMPOSE["services"]
    assert set(services) == {"ray-head", "context-node", "generation-node", "serve"}
    for name, words in compose_commands().items():
        assert services[name]["working_dir"] == "/windserve"
        assert ".:/windserve" in services[name]["volumes"]
        for word in words:
            if re.fullmatch(r"[\w./-]+\.(yaml|yml|py|toml)", word):
                assert (ROOT / word).is_file(), f"{name} names {word}, which does not exist"
        if "-e" in words:
            extra = re.fullmatch(r"\.\[(\w+)\]", words[words.index("-e") + 1]).group(1)
            assert f"\n{extra} = [" in (ROOT / "pyproject.toml").read_text(), f"no extra [{extra}]"
    assert "configs/cluster.yaml" in compose_commands()["serve"]


def test_compose_nodes_share_the_auth_token_and_join_the_head():
    for name, service in COMPOSE["services"].items():
        env = service["environment"]
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN"), name
        if name != "ray-head":
            assert "--address=ray-head:6379" in compose_commands()[name]
    assert "--port=6379" in compose_commands()["ray-head"]


def node_resources() -> set[str]:
    names = set()
    for words in compose_commands().values():
        for word in words:
            if word.startswith("--resources="):
                names |= set(json.loads(word.split("=", 1)[1]))
    return names


def test_cluster_config_asks_only_for_resources_the_compose_nodes_offer():
    asked = set()
    for app in serve_config(ROOT / "configs" / "cluster.yaml").applications:
        for deployment in app.deployments:
            asked |= set(getattr(deployment.ray_actor_options, "resources", None) or {})
            assert deployment.name == "Ingress" or isinstance(deployment.autoscaling_config, dict)
    assert asked == {"context_node", "generation_node"}
    assert asked <= node_resources()


def test_app_config_maps_onto_the_worker_config():
    config = AppConfig.model_validate({"tokens_per_block": 8, "num_pages": 64, "max_model_len": 100,
                                       "max_draft_len": 2, "device": "cpu", "lease_s": 5})
    worker = config.to_worker_config()
    assert isinstance(worker, WorkerConfig) and (worker.transport, worker.lease_s) == ("nixl", 5)
    engine = worker.engine
    assert (engine.model, engine.tokens_per_block, engine.num_pages, engine.max_model_len, engine.max_draft_len,
            engine.device) == ("windserve-tiny", 8, 64, 100, 2, "cpu")


@pytest.mark.parametrize("args, message", [
    ({"modle": "x"}, "Extra inputs are not permitted"),
    ({"mode": "both"}, "'disagg' or 'aggregated'"),
    ({"transport": "local"}, "needs transport 'nixl'"),
    ({"num_pages": 0}, "greater than or equal to 1"),
    ({"device": "tpu"}, "device must be"),
    ({"api_key": ""}, "api_key must be non-empty"),
    ({"max_queue": -1}, "greater than or equal to 0"),
])
def test_app_config_rejects_with_a_clear_error(args, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        AppConfig.model_validate(args)


def test_api_key_comes_from_the_environment_when_unset(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert AppConfig().api_key == "from-env"
    assert AppConfig(api_key="explicit").api_key == "explicit"
    monkeypatch.delenv(API_KEY_ENV)
    assert AppConfig().api_key is None
    assert AppConfig(mode="aggregated", transport="local").transport == "local"
