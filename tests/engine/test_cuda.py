"""On a CUDA GPU: our models and engine against transformers on the same device and weights.

Skipped where there is no GPU (CI); ``bench/gpu_check.sh`` runs them (``-m gpu``).
float32 means float32 on both sides (TF32 off), held to the CPU parity tests' 1e-4;
bf16 to test_bf16's tolerance; greedy tokens must be equal; disaggregated == aggregated
exactly in bf16, pages copied on the device by ordinal.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.tiny import ensure_tiny_model
from engine.worker_model import WorkerModel
from tests.engine.helpers import CONFIGS, PagedKV, greedy, load_pair, relative_error
from tests.engine.test_bf16 import TOLERANCE, bf16_reference, check_disaggregated_equals_aggregated

CUDA = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
torch.backends.cuda.matmul.allow_tf32 = False  # module-scoped fixtures compute references before any function fixture
torch.backends.cudnn.allow_tf32 = False


def random_prompt(length: int, seed: int = 1, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=CUDA)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_float32_logits_and_greedy_tokens_match_transformers(arch):
    reference, ours, config = load_pair(arch)
    reference, ours = reference.to(CUDA), ours.to(CUDA)
    tokens = random_prompt(37)  # past the window of 8, over pages of 4
    with torch.no_grad():
        exact = reference(torch.tensor([tokens], device=CUDA)).logits[0]
        logits = ours(PagedKV.for_config(config, 4, device=CUDA).batch([(0, tokens, 0)]))
        assert logits.is_cuda
        assert relative_error(logits, exact) < 1e-4
        assert greedy(ours, PagedKV.for_config(config, 4, device=CUDA), tokens, 16) == hf_greedy(reference, tokens, 16)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_bf16_logits_match_transformers_in_bf16(arch):
    reference, ours, config = load_pair(arch, dtype=torch.bfloat16)
    theirs_model = bf16_reference(reference).to(CUDA)
    reference, ours = reference.to(CUDA), ours.to(CUDA)
    tokens = random_prompt(21)
    ids = torch.tensor([tokens], device=CUDA)
    with torch.no_grad():
        exact = reference(ids).logits[0].float()
        theirs = theirs_model(ids).logits[0].float()
        logits = ours(PagedKV.for_config(config, 4, torch.bfloat16, device=CUDA).batch([(0, tokens, 0)]))
    assert relative_error(logits, theirs) < TOLERANCE
    assert relative_error(logits, exact) <= 2 * relative_error(theirs, exact) + 5e-3


@pytest.fixture(scope="module")
def tiny_reference():
    """windserve-tiny's greedy tokens from transformers on the GPU, prompts as in test_engine_vs_transformers."""
    path = ensure_tiny_model()
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    hf = hf.to(CUDA).eval()
    prompts = [random_prompt(n, seed=7 + n, vocab=256) for n in (7, 33, 50, 71, 200)]
    with torch.inference_mode():
        return path, prompts, [hf_greedy(hf, p, 32) for p in prompts]


@pytest.mark.parametrize("tokens_per_block,draft_len,budget", [(8, 0, 1024), (16, 0, 24), (8, 3, 40), (8, 0, 100)])
def test_engine_greedy_tokens_match_transformers(tiny_reference, tokens_per_block, draft_len, budget):
    path, prompts, expected = tiny_reference
    llm = LLM(path, device=CUDA, dtype="float32", tokens_per_block=tokens_per_block, max_draft_len=draft_len,
              max_num_batched_tokens=budget)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=32, ignore_eos=True))
    manager = llm.engine.manager
    assert all(t.is_cuda for t in manager.storage.tensors.values())
    for prompt, output, want in zip(prompts, outputs, expected):
        assert output.token_ids == want, f"prompt of {len(prompt)} tokens diverges"
    assert manager.num_free_pages() == manager.num_total_pages()


@pytest.mark.parametrize("draft_len", [0, 3])
def test_bf16_disaggregated_equals_aggregated(draft_len):
    check_disaggregated_equals_aggregated(WorkerModel.load(EngineConfig(device=CUDA, dtype="bfloat16")), draft_len)
