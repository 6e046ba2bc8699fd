"""windserve-tiny: built locally, deterministic, loadable by transformers, not degenerate."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from engine.loader import ModelLoadError
from engine.model_registry import resolve_model_path
from engine.tiny import (
    TINY_MODEL_DIRNAME,
    TINY_MODEL_NAME,
    ensure_tiny_model,
    param_shapes,
    tiny_config_dict,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return ensure_tiny_model(str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_dir, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model.eval()


def test_directory_is_a_complete_hf_model_dir(tiny_dir):
    assert os.path.basename(tiny_dir) == TINY_MODEL_DIRNAME
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert os.path.isfile(os.path.join(tiny_dir, name)), name


def test_param_shapes_match_transformers_gpt_oss():
    config = transformers.GptOssConfig(**tiny_config_dict())
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == param_shapes(tiny_config_dict())


def test_transformers_loads_model_and_tokenizer_offline(tiny_dir, hf_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    config = hf_model.config
    assert tokenizer.is_fast
    assert config.model_type == "gpt_oss" and config.vocab_size == len(tokenizer)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.sliding_window == 32 and config.rope_parameters["rope_type"] == "yarn"
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (
        tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id)
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    assert hf_model.generation_config.eos_token_id == [tokenizer.eos_token_id, end_id]


def test_fresh_creations_are_byte_identical(tmp_path):
    first = ensure_tiny_model(str(tmp_path / "a"))
    second = ensure_tiny_model(str(tmp_path / "b"))
    a, b = load_file(os.path.join(first, "model.safetensors")), load_file(os.path.join(second, "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32
        assert a[name].numpy().tobytes() == b[name].numpy().tobytes(), name
    for file in sorted(os.listdir(first)):
        with open(os.path.join(first, file), "rb") as fa, open(os.path.join(second, file), "rb") as fb:
            assert fa.read() == fb.read(), file


def test_weights_are_not_degenerate(tiny_dir):
    weights = load_file(os.path.join(tiny_dir, "model.safetensors"))
    for name, tensor in weights.items():
        assert torch.isfinite(tensor).all() and tensor.std() > 0, name
    assert 0.8 < weights["model.layers.0.input_layernorm.weight"].mean() < 1.2


def test_greedy_generation_is_not_one_repeated_token(hf_model):
    prompt = torch.tensor([list(b"Hello, windserve!")])
    with torch.no_grad():
        out = hf_model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    generated = out[0, prompt.shape[1]:].tolist()
    assert len(generated) == 16 and len(set(generated)) > 1, generated


def test_next_token_depends_on_tokens_outside_the_window(hf_model):
    """Position 0 is outside every sliding window at position 47: only full layers carry it."""
    ids = torch.arange(48).remainder(200).unsqueeze(0) + 32
    changed = ids.clone()
    changed[0, 0] += 1
    with torch.no_grad():
        logits, changed_logits = hf_model(ids).logits[0, -1], hf_model(changed).logits[0, -1]
    assert (logits - changed_logits).abs().max() > 1e-3


def test_ensure_reuses_an_existing_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WINDSERVE_CACHE", str(tmp_path))
    path = resolve_model_path(TINY_MODEL_NAME)
    assert path == str(tmp_path / TINY_MODEL_DIRNAME)
    mtime = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert ensure_tiny_model() == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == mtime


def test_racing_creators_agree_and_leave_no_temporaries(tmp_path):
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(ensure_tiny_model(str(tmp_path)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert paths == [str(tmp_path / TINY_MODEL_DIRNAME)] * 4
    assert os.listdir(tmp_path) == [TINY_MODEL_DIRNAME]


def test_loser_of_the_rename_race_uses_the_winners_directory(tmp_path, monkeypatch):
    real_rename = os.rename

    def rename_after_a_rival_won(src, dst):
        os.makedirs(dst)
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write("{}")
        return real_rename(src, dst)

    monkeypatch.setattr("engine.tiny.os.rename", rename_after_a_rival_won)
    path = ensure_tiny_model(str(tmp_path))
    assert os.listdir(path) == ["config.json"]  # the rival's copy, untouched
    assert os.listdir(tmp_path) == [TINY_MODEL_DIRNAME]


def test_resolve_model_path_accepts_local_directories_only(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelLoadError, match="local") as err:
        resolve_model_path("openai/gpt-oss-20b")
    assert isinstance(err.value, ValueError)
