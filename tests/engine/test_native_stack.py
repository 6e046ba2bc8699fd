"""engine.models.native_stack: every layer of a few-row step in one native call gives the modules' logits and
KV pages bit for bit (float32 weights packed as load_model packs them, and GGUF blocks), for Llama, Mistral
(every layer sliding) and Qwen2 (biases; some layers sliding), over batches of requests of ragged lengths
with one or two new tokens each (decode and verify) and pages of 4 to 16 tokens; NaN fills every page no
query may read. It is built only where it runs what the modules run."""

from __future__ import annotations

import contextlib
import copy
import os

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.loader import load_model
from engine.model_registry import resolve_model_path
from engine.models import native_stack
from engine.models.decoder import fuse_projections
from engine.models.packed import pack_for_cpu
from engine.native import decode_stack_class
from tests.engine.engine_fixtures import built_kernel
from tests.engine.gguf_writer import write_gguf
from tests.engine.helpers import CONFIGS, PagedKV, load_pair
from tests.engine.test_gguf_quantized import ARCHS as GGUF_ARCHS

torch.set_num_threads(1)
FLOAT32_ARCHS = ["llama", "mistral", "qwen2", "qwen2_sliding"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return built_kernel(decode_stack_class)


def packed(arch: str):
    """(our model as load_model prepares it, q/k/v fused and every weight packed, its config)."""
    _, ours, config = load_pair(arch)
    return pack_for_cpu(fuse_projections(ours), min_elements=0), config


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory) -> dict:
    """A GGUF file of each format for Llama (tied head) and Qwen2, loaded with its blocks kept."""
    models = {}
    for arch, make in GGUF_ARCHS.items():
        for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
            directory = tmp_path_factory.mktemp(f"{arch}-{qtype.name}")
            torch.manual_seed(0)
            reference = AutoModelForCausalLM.from_config(make())
            reference.save_pretrained(str(directory / "hf"))
            path = str(directory / "model.gguf")
            state = load_file(str(directory / "hf" / "model.safetensors"))
            write_gguf(path, arch, reference.config, state, qtype=qtype)
            converted = resolve_model_path(path, cache_dir=str(directory / "cache"))
            model = load_model(converted, gguf_path=path)
            models[f"{arch}-{qtype.name}"] = (model, model.config)
    return models


@contextlib.contextmanager
def stack_calls(on: bool):
    """The stack on or off for the steps inside, and the number of steps it ran."""
    calls = [0]
    original = native_stack.NativeStack.__call__

    def counted(self, hidden, ctx):
        calls[0] += 1
        return original(self, hidden, ctx)

    before = os.environ.get("WINDSERVE_NATIVE_STACK")
    os.environ["WINDSERVE_NATIVE_STACK"] = "1" if on else "0"
    native_stack.NativeStack.__call__ = counted
    try:
        yield calls
    finally:
        native_stack.NativeStack.__call__ = original
        if before is None:
            os.environ.pop("WINDSERVE_NATIVE_STACK")
        else:
            os.environ["WINDSERVE_NATIVE_STACK"] = before


def assert_step_equal(model, config, prompt_lens: list[int], new_lens: list[int], block: int, seed: int) -> None:
    """Prefill each request (the modules), then one step of ``new_lens[r]`` tokens each, stack on and off on
    copies of the pages: logits and pages equal bit for bit (NaN where NaN), the stack ran that step only."""
    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size
    cache = PagedKV.for_config(config, block)
    with torch.inference_mode(), stack_calls(on=False):
        for r, length in enumerate(prompt_lens):
            model(cache.batch([(r, torch.randint(0, vocab, (length,), generator=gen).tolist(), 0)]))
    step = [(r, torch.randint(0, vocab, (n,), generator=gen).tolist(), length)
            for r, (length, n) in enumerate(zip(prompt_lens, new_lens))]
    other = copy.deepcopy(cache)
    with torch.inference_mode():
        with stack_calls(on=True) as on_calls:
            got = model(cache.batch(step))
        with stack_calls(on=False) as off_calls:
            want = model(other.batch(step))
    assert on_calls[0] == 1 and off_calls[0] == 0
    assert torch.equal(got, want)
    for group, pages in cache.kv.items():
        torch.testing.assert_close(pages, other.kv[group], rtol=0, atol=0, equal_nan=True)


steps = dict(prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
             verify=st.booleans(), block=st.sampled_from([4, 8, 16]), seed=st.integers(0, 10_000))


@pytest.mark.parametrize("arch", FLOAT32_ARCHS)
@settings(max_examples=12, deadline=None)
@given(**steps)
def test_float32_step_equals_the_modules_bit_for_bit(arch, prompt_lens, verify, block, seed):
    if arch not in _packed_cache:
        _packed_cache[arch] = packed(arch)
    model, config = _packed_cache[arch]
    assert_step_equal(model, config, prompt_lens, [2 if verify else 1] * len(prompt_lens), block, seed)


_packed_cache: dict = {}


@settings(max_examples=16, deadline=None)
@given(**steps, which=st.sampled_from(["llama-Q8_0", "llama-Q4_1", "qwen2-Q8_0", "qwen2-Q4_1"]))
def test_quantized_step_equals_the_modules_bit_for_bit(quantized_models, prompt_lens, verify, block, seed, which):
    model, config = quantized_models[which]
    assert_step_equal(model, config, prompt_lens, [2 if verify else 1] * len(prompt_lens), block, seed)


def test_built_only_where_it_runs_what_the_modules_run():
    for arch in FLOAT32_ARCHS:
        assert native_stack.build(packed(arch)[0]) is not None, arch
    _, unpacked, _ = load_pair("llama")  # plain nn.Linear: F.linear (MKL), not the few-row kernel
    assert native_stack.build(fuse_projections(unpacked)) is None
    assert native_stack.build(packed("gpt_oss")[0]) is None  # sinks, MoE


def test_a_step_with_a_bucket_or_many_rows_takes_the_modules():
    model, config = packed("llama")
    cache = PagedKV.for_config(config, 8)
    with torch.inference_mode(), stack_calls(on=True) as calls:
        model(cache.batch([(0, list(range(9)), 0)]))  # 9 rows: more than the few-row kernels take
        assert calls[0] == 0
        model(cache.batch([(0, [1], 9)]))
        assert calls[0] == 1
