"""Loading local Hugging Face-format directories, and the errors that say what is wrong."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.loader import (
    ModelLoadError,
    check_architecture,
    load_config,
    load_model,
    load_state_dict,
    load_weights,
)
from engine.tiny import ensure_tiny_model

TENSORS = {
    "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b.bias": torch.tensor([1.5, -2.0]),
    "c.scale": torch.tensor([7], dtype=torch.int64),
}


def write_dir(path, config: dict | None = None, shards: dict[str, dict] | None = None, index: dict | None = None):
    os.makedirs(path, exist_ok=True)
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    for file, tensors in (shards or {}).items():
        save_file(tensors, os.path.join(path, file))
    if index is not None:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f)
    return str(path)


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]) and got[name].dtype == want[name].dtype, name


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return ensure_tiny_model(str(tmp_path_factory.mktemp("cache")))


# --- config ---------------------------------------------------------------

def test_load_config_reads_a_local_directory(tiny_dir):
    config = load_config(tiny_dir)
    assert config.model_type == "gpt_oss" and config.architectures == ["GptOssForCausalLM"]
    assert config.num_hidden_layers == 4 and config.sliding_window == 32


def test_load_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_config(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_config(write_dir(tmp_path / "empty"))
    broken = write_dir(tmp_path / "broken")
    with open(os.path.join(broken, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_config(broken)


# --- state dict -----------------------------------------------------------

def test_single_file(tmp_path):
    assert_same(load_state_dict(write_dir(tmp_path, shards={"model.safetensors": TENSORS})), TENSORS)


def test_sharded_index_merges_shards(tmp_path):
    shards = {"model-00001-of-00002.safetensors": {"a.weight": TENSORS["a.weight"]},
              "model-00002-of-00002.safetensors": {"b.bias": TENSORS["b.bias"], "c.scale": TENSORS["c.scale"]}}
    index = {name: file for file, tensors in shards.items() for name in tensors}
    assert_same(load_state_dict(write_dir(tmp_path, shards=shards, index=index)), TENSORS)


def test_sharded_index_takes_only_the_listed_tensors(tmp_path):
    shards = {"s1.safetensors": TENSORS}
    path = write_dir(tmp_path, shards=shards, index={"a.weight": "s1.safetensors"})
    assert load_state_dict(path).keys() == {"a.weight"}


def test_missing_shard_is_named(tmp_path):
    index = {"a.weight": "s1.safetensors", "b.bias": "s2.safetensors"}
    path = write_dir(tmp_path, shards={"s1.safetensors": {"a.weight": TENSORS["a.weight"]}}, index=index)
    with pytest.raises(ModelLoadError, match="missing: s2.safetensors"):
        load_state_dict(path)


def test_tensor_absent_from_its_shard_is_named(tmp_path):
    index = {"a.weight": "s1.safetensors", "b.bias": "s1.safetensors"}
    path = write_dir(tmp_path, shards={"s1.safetensors": {"a.weight": TENSORS["a.weight"]}}, index=index)
    with pytest.raises(ModelLoadError, match="b.bias"):
        load_state_dict(path)


def test_no_weights_and_unreadable_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="no safetensors"):
        load_state_dict(write_dir(tmp_path / "none", config={}))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_state_dict(str(tmp_path / "nowhere"))
    corrupt = write_dir(tmp_path / "corrupt")
    with open(os.path.join(corrupt, "model.safetensors"), "wb") as f:
        f.write(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_state_dict(corrupt)
    with open(os.path.join(corrupt, "model.safetensors.index.json"), "w") as f:
        f.write("[]")
    os.remove(os.path.join(corrupt, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="weight_map"):
        load_state_dict(corrupt)


# --- fitting a state dict to a model --------------------------------------

class Toy(nn.Module):
    def __init__(self, num_layers: int = 1, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(num_layers))
        self.head = nn.Linear(3, 5, bias=False)
        if tied:  # as a tied model must: it says itself that the checkpoint stores head.weight as embed.weight
            self.head.weight = self.embed.weight
            self.register_load_state_dict_pre_hook(self._tie_head)

    @staticmethod
    def _tie_head(module, state_dict, prefix, *args):
        if prefix + "embed.weight" in state_dict:
            state_dict.setdefault(prefix + "head.weight", state_dict[prefix + "embed.weight"])


def toy_state(num_layers: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=generator) for k, v in Toy(num_layers).state_dict().items()}


def test_load_weights_copies_and_casts_values():
    model, state = Toy().to(torch.bfloat16), toy_state()
    load_weights(model, state)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_missing_and_unexpected_keys_are_named():
    state = toy_state()
    with pytest.raises(ModelLoadError, match=r'Missing key\(s\) in state_dict: "layers\.0\.bias"'):
        load_weights(Toy(), {k: v for k, v in state.items() if k != "layers.0.bias"})
    with pytest.raises(ModelLoadError, match=r'Unexpected key\(s\) in state_dict: "extra\.weight"'):
        load_weights(Toy(), {**state, "extra.weight": torch.zeros(1)})


def test_shape_mismatch_names_tensor_and_both_shapes():
    state = {**toy_state(), "layers.0.weight": torch.zeros(3, 4)}
    with pytest.raises(ModelLoadError, match=r"size mismatch for layers\.0\.weight: .*\[3, 4\].*\[3, 3\]"):
        load_weights(Toy(), state)


def test_tied_weight_may_be_absent():
    model = Toy(tied=True)
    state = {k: v for k, v in toy_state().items() if k != "head.weight"}
    load_weights(model, state)
    assert torch.equal(model.head.weight, state["embed.weight"])


def test_unsupported_architecture_lists_the_supported_ones(tiny_dir):
    config = load_config(tiny_dir)
    assert check_architecture(config, {"GptOssForCausalLM": Toy}) == "GptOssForCausalLM"
    with pytest.raises(ModelLoadError, match=r"'GptOssForCausalLM'; supported: LlamaForCausalLM, Toy"):
        check_architecture(config, {"Toy": Toy, "LlamaForCausalLM": Toy})
    config.architectures = None
    with pytest.raises(ModelLoadError, match="exactly one architecture"):
        check_architecture(config, {"Toy": Toy})


# --- load_model: needs engine.models (another engineer's) -----------------

needs_models = pytest.mark.skipif(importlib.util.find_spec("engine.models") is None,
                                  reason="engine.models has not landed yet")


@needs_models
def test_load_model_loads_the_tiny_model_exactly(tiny_dir):
    model = load_model(tiny_dir)
    weights = load_file(os.path.join(tiny_dir, "model.safetensors"))
    state = model.state_dict()
    assert not model.training
    for name, tensor in weights.items():
        assert torch.equal(state[name].float(), tensor), name


@needs_models
def test_load_model_rejects_an_unregistered_architecture(tiny_dir, tmp_path):
    from engine.models import MODEL_REGISTRY

    path = shutil.copytree(tiny_dir, tmp_path / "other")
    with open(path / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["NoSuchModelForCausalLM"]
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match="NoSuchModelForCausalLM") as err:
        load_model(str(path))
    assert all(name in str(err.value) for name in MODEL_REGISTRY)


@needs_models
def test_load_model_loads_a_tied_transformers_checkpoint(tmp_path):
    """transformers saves a tied lm_head once (as the embedding); strict loading must accept that, and a copy."""
    from transformers import AutoModelForCausalLM

    from tests.engine.helpers import CONFIGS

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path)
    weights = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "lm_head.weight" not in weights
    model = load_model(str(tmp_path))
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    with_copy = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}
    save_file(with_copy, os.path.join(tmp_path, "model.safetensors"))
    load_model(str(tmp_path))
