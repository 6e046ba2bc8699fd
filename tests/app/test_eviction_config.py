"""The cache eviction policy per role: validated at every layer of the config chain, keep-hot on
generation workers and LRU on context workers by default, and a YAML value reaches the worker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig
from app.serve_app import build_app
from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
DISAGG_CONFIGS = [p for p in sorted((ROOT / "configs").glob("*.yaml")) if "aggregated" not in p.name]


def test_engine_config_takes_the_two_policies_and_rejects_others():
    assert EngineConfig().eviction == "lru"
    assert EngineConfig(eviction="keep-hot").eviction == "keep-hot"
    with pytest.raises(ValueError, match=re.escape("eviction must be one of ['lru', 'keep-hot'], got 'fifo'")):
        EngineConfig(eviction="fifo")


def test_roles_default_to_keep_hot_for_generation_and_lru_for_context():
    config = AppConfig.model_validate({})
    assert [config.to_worker_config(role).eviction for role in ("context", "generation")] == ["lru", "keep-hot"]
    aggregated = AppConfig.model_validate({"mode": "aggregated", "transport": "local"})
    assert aggregated.to_worker_config().eviction == "lru"
    assert AppConfig.model_validate({"mode": "aggregated", "transport": "local",
                                     "eviction": "keep-hot"}).to_worker_config().eviction == "keep-hot"


def test_each_role_is_set_on_its_own():
    swapped = AppConfig.model_validate({"context_eviction": "keep-hot", "generation_eviction": "lru"})
    assert [swapped.to_worker_config(role).eviction for role in ("context", "generation")] == ["keep-hot", "lru"]
    one_set = AppConfig.model_validate({"generation_eviction": "lru"})
    assert [one_set.to_worker_config(role).eviction for role in ("context", "generation")] == ["lru", "lru"]


@pytest.mark.parametrize("path", DISAGG_CONFIGS, ids=lambda p: p.name)
def test_disagg_configs_state_each_roles_eviction_and_it_reaches_the_bound_workers(path):
    (app,) = yaml.safe_load(path.read_text())["applications"]
    assert (app["args"]["context_eviction"], app["args"]["generation_eviction"]) == ("lru", "keep-hot")
    override = app["args"] | {"generation_eviction": "lru", "context_eviction": "keep-hot"}
    for args, expected in ((app["args"], ("lru", "keep-hot")), (override, ("keep-hot", "lru"))):
        workers = build_app(args)._bound_deployment.init_kwargs  # binds only; starts nothing
        bound = {role: workers[role]._bound_deployment.init_args[0].eviction for role in ("context", "generation")}
        assert (bound["context"], bound["generation"]) == expected, path.name


@pytest.mark.parametrize("args, message", [
    ({"generation_eviction": "fifo"}, "generation_eviction must be one of ['lru', 'keep-hot'], got 'fifo'"),
    ({"eviction": "fifo", "mode": "aggregated", "transport": "local"}, "eviction must be one of"),
    ({"eviction": "keep-hot"}, "mode 'disagg' takes context_eviction / generation_eviction"),
    ({"mode": "aggregated", "transport": "local", "context_eviction": "lru"},
     "context_eviction sets a disagg role's cache; mode 'aggregated' takes eviction only"),
])
def test_app_config_rejects_a_bad_eviction_with_a_clear_error(args, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        AppConfig.model_validate(args)
