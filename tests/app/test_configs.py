"""configs/*.yaml and docker-compose.yml agree with Serve's schema, AppConfig and each other (no Ray, no Docker)."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from actors.config import WorkerConfig
from app.config import API_KEY_ENV, AppConfig
from app.routing import ROUTER_PATH, CostScales
from app.serve_app import INGRESS_MAX_QUEUED_REQUESTS, SERVE_CONTROLLER_OPTIONS, Ingress, build_app
from app.serve_workers import AggregatedDeployment, ContextDeployment, GenerationDeployment, WorkerStats
from engine.config import EngineConfig
from engine.model_registry import resolve_model_path

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


def test_smollm2_config_serves_the_real_model_disaggregated():
    assert ROOT / "configs" / "smollm2.yaml" in CONFIGS  # so the checks of every config above cover it
    config = AppConfig.model_validate(serve_config(ROOT / "configs" / "smollm2.yaml").applications[0].args)
    assert (config.mode, config.model, config.served_model) == ("disagg", "smollm2-135m-instruct",
                                                                "smollm2-135m-instruct")


@pytest.mark.parametrize("args, served", [
    ({}, "windserve-tiny"),
    ({"model": "/models/Qwen2-0.5B-Instruct/"}, "Qwen2-0.5B-Instruct"),
    ({"model": "~/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"}, "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ({"model": "/models/Qwen2-0.5B-Instruct", "served_model_name": "qwen"}, "qwen"),
])
def test_served_model_name_defaults_to_the_short_name(args, served):
    assert AppConfig.model_validate(args).served_model == served


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_through_serve_and_app_config(path):
    for app in serve_config(path).applications:
        assert app.import_path == "app.serve_app:build_app"
        config = AppConfig.model_validate(app.args)
        # Serve's own call of the builder (it checks the builder's signature); binds, starts nothing
        call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
        unknown = {d.name for d in app.deployments} - DEPLOYMENTS[config.mode]
        assert not unknown, f"{path.name} overrides deployments the app does not have: {unknown}"
        assert config.handle_transport == "grpc"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_configs_start_serve_with_the_proxy_on_grpc(path):
    """``serve run`` starts Serve's controller with the config's controller_options; the proxy inherits them."""
    options = serve_config(path).controller_options
    assert options is not None and options.model_dump(exclude_none=True) == SERVE_CONTROLLER_OPTIONS


def test_local_configs_serve_on_loopback():
    for name in ("disagg.yaml", "aggregated.yaml"):
        config = serve_config(ROOT / "configs" / name)
        assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)
    disagg_args = serve_config(ROOT / "configs" / "disagg.yaml").applications[0].args
    assert AppConfig.model_validate(disagg_args).mode == "disagg"


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


def node_units() -> dict[str, int]:
    units = {}
    for words in compose_commands().values():
        for word in words:
            if word.startswith("--resources="):
                units.update(json.loads(word.split("=", 1)[1]))
    return units


def test_cluster_config_routes_by_kv_over_at_least_two_replicas_of_each_worker():
    (app,) = serve_config(ROOT / "configs" / "cluster.yaml").applications
    workers = {d.name: d for d in app.deployments if d.name != "Ingress"}
    assert set(workers) == {"ContextWorker", "GenerationWorker"}
    for deployment in workers.values():
        router = deployment.request_router_config
        assert router["request_router_class"] == ROUTER_PATH
        assert CostScales(**router["request_router_kwargs"])  # only the router's own knobs, valid
        scaling = deployment.autoscaling_config
        assert scaling["min_replicas"] >= 2
        (resource,) = deployment.ray_actor_options.resources
        assert node_units()[resource] >= scaling["max_replicas"], resource  # the compose node can host them all
    assert AppConfig.model_validate(app.args).local_prefill_max_tokens >= 0


def test_app_config_maps_onto_the_worker_config():
    config = AppConfig.model_validate({"tokens_per_block": 8, "num_pages": 64, "max_model_len": 100,
                                       "max_draft_len": 2, "device": "cpu", "lease_s": 5})
    worker = config.to_worker_config()
    assert isinstance(worker, WorkerConfig) and (worker.transport, worker.lease_s) == ("nixl", 5)
    assert (worker.model, worker.tokens_per_block, worker.num_pages, worker.max_model_len, worker.max_draft_len,
            worker.device) == ("windserve-tiny", 8, 64, 100, 2, "cpu")


def test_every_worker_and_engine_knob_is_reachable_from_the_args():
    """Each field of the chain is declared once (engine, worker, app) and every one is settable."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)} - engine_fields
    app_fields = {f.name for f in dataclasses.fields(AppConfig)} - engine_fields - worker_fields
    assert app_fields == {"mode", "api_key", "max_queue", "served_model_name", "local_prefill_max_tokens",
                          "context_num_pages", "generation_num_pages", "context_eviction", "generation_eviction",
                          "handle_transport", "engine_in_ingress", "ttft_slo_s", "tpot_slo_s"}
    assert {"claim_s", "transfer_timeout_s", "reserve_timeout_s", "torch_threads"} <= worker_fields
    assert {"drafter", "num_extra_kv_tokens", "seed"} <= engine_fields
    args = {"drafter": "none", "num_extra_kv_tokens": 3, "seed": 7, "claim_s": 9, "transfer_timeout_s": 11,
            "reserve_timeout_s": 13, "torch_threads": 2, "lease_s": 4}
    worker = AppConfig.model_validate(args).to_worker_config()
    assert type(worker) is WorkerConfig and "api_key" not in {f.name for f in dataclasses.fields(worker)}
    assert {name: getattr(worker, name) for name in args} == args
    assert isinstance(worker, EngineConfig)  # what LLMEngine takes


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_configs_state_prefix_caching_and_it_reaches_the_workers(path):
    for app in serve_config(path).applications:
        assert app.args["enable_prefix_caching"] is True
        assert AppConfig.model_validate(app.args).to_worker_config().enable_prefix_caching is True
    off = AppConfig.model_validate({"enable_prefix_caching": False}).to_worker_config()
    assert off.enable_prefix_caching is False and AppConfig.model_validate({}).enable_prefix_caching is True


def test_serving_max_model_len_counts_the_configured_scratch():
    # windserve-tiny: 4096 positions; 16 pages of 8 tokens hold 128, less drafts and extra slots.
    path = resolve_model_path("windserve-tiny")
    config = AppConfig.model_validate({"tokens_per_block": 8, "num_pages": 16, "max_draft_len": 3,
                                       "num_extra_kv_tokens": 2})
    assert config.serving_max_model_len(path) == 128 - 3 - 2
    assert AppConfig.model_validate({"max_model_len": 100}).serving_max_model_len(path) == 100


def test_each_disagg_role_gets_its_own_pages():
    """context_num_pages / generation_num_pages size each role's workers; unset: num_pages. The
    longest request served is what the smaller role holds (windserve-tiny: 4096 positions)."""
    config = AppConfig.model_validate({"tokens_per_block": 8, "num_pages": 64, "context_num_pages": 32,
                                       "generation_num_pages": 128})
    pages = {role: config.to_worker_config(role).num_pages for role in ("context", "generation", None)}
    assert pages == {"context": 32, "generation": 128, None: 64}
    assert config.serving_max_model_len(resolve_model_path("windserve-tiny")) == 32 * 8
    one_set = AppConfig.model_validate({"num_pages": 64, "generation_num_pages": 96})
    assert [one_set.to_worker_config(r).num_pages for r in ("context", "generation")] == [64, 96]


@pytest.mark.parametrize("path", [p for p in CONFIGS if "aggregated" not in p.name], ids=lambda p: p.name)
def test_disagg_configs_size_both_roles(path):
    for app in serve_config(path).applications:
        config = AppConfig.model_validate(app.args)
        assert config.context_num_pages is not None and config.generation_num_pages is not None, path
        assert config.to_worker_config("generation").num_pages == app.args["generation_num_pages"]


@pytest.mark.parametrize("args, message", [
    ({"modle": "x"}, "Unexpected keyword argument"),
    ({"mode": "both"}, "'disagg' or 'aggregated'"),
    ({"handle_transport": "tcp"}, "'grpc' or 'ray'"),
    ({"transport": "local"}, "needs transport 'nixl'"),
    ({"num_pages": 0}, "greater than or equal to 1"),
    ({"device": "tpu"}, "device must be"),
    ({"api_key": ""}, "api_key must be non-empty"),
    ({"max_queue": -1}, "greater than or equal to 0"),
    ({"local_prefill_max_tokens": -1}, "local_prefill_max_tokens must be greater than or equal to 0"),
    ({"num_pages": "many"}, "Input should be a valid integer"),
    ({"drafter": "eagle"}, "unknown drafter kind 'eagle'"),
    ({"claim_s": 0}, "claim_s must be greater than 0"),
    ({"torch_threads": 0}, "greater than or equal to 1"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"served_model_name": ""}, "served_model_name must be non-empty"),
    ({"context_num_pages": 0}, "context_num_pages must be greater than or equal to 1"),
    ({"generation_num_pages": "many"}, "Input should be a valid integer"),
    ({"mode": "aggregated", "transport": "local", "generation_num_pages": 64},
     "generation_num_pages sizes a disagg role; mode 'aggregated' takes num_pages only"),
    ({"engine_in_ingress": True}, "engine_in_ingress runs one aggregated engine in the ingress; mode 'disagg'"),
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


def test_serve_bounds_the_proxy_queue_only_when_max_queue_asks_for_admission():
    # serve.Application has no public view of its options; the bound deployment is the ingress.
    limited = build_app({"mode": "aggregated", "transport": "local", "max_queue": 4})._bound_deployment
    unlimited = build_app({"mode": "aggregated", "transport": "local"})._bound_deployment
    assert limited.name == unlimited.name == "Ingress"
    assert (limited.max_queued_requests, unlimited.max_queued_requests) == (INGRESS_MAX_QUEUED_REQUESTS, -1)
    assert limited.max_ongoing_requests == unlimited.max_ongoing_requests  # the admission limit is max_queue's


def test_engine_in_ingress_builds_one_ingress_with_the_engine_and_no_worker_deployment():
    app = build_app({"mode": "aggregated", "transport": "local", "engine_in_ingress": True, "max_queue": 4})
    ingress = app._bound_deployment
    assert ingress.name == "Ingress" and ingress.func_or_class.__name__ == "EngineIngress"
    assert ingress.max_queued_requests == INGRESS_MAX_QUEUED_REQUESTS
    config, board = ingress.init_args  # the config and the stats board: no worker deployment bound
    assert config.engine_in_ingress and board._bound_deployment.name == "WorkerStats" and not ingress.init_kwargs
