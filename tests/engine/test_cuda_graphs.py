"""On a CUDA GPU: decode/verify steps replayed as CUDA graphs (engine.gpu.graph_runner) give the eager
static step's tokens and logits, and transformers' greedy tokens, in float32.

Skipped where there is no GPU (CI); ``bench/gpu_check.sh`` runs them (``-m gpu``, its ``graph`` step).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.gpu.graph_runner import CudaGraphs
from engine.gpu.static_runner import static_forward
from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape
from tests.engine.helpers import PagedKV, load_pair, relative_error
from tests.engine.test_cuda import tiny_reference  # noqa: F401
from tests.engine.test_mixed_static import run_with_arrivals

CUDA = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
B, WIDTH = 4, 16


def llm(path: str, draft_len: int, enforce_eager: bool, async_scheduling: bool | None = None) -> LLM:
    return LLM(path, device=CUDA, dtype="float32", tokens_per_block=8, max_draft_len=draft_len, max_num_seqs=8,
               enforce_eager=enforce_eager, async_scheduling=async_scheduling)


@pytest.mark.parametrize("draft_len", [0, 3])
def test_graph_tokens_equal_eager_and_transformers(tiny_reference, draft_len):
    path, prompts, expected = tiny_reference
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    graphed, eager = llm(path, draft_len, False), llm(path, draft_len, True)
    static = graphed.engine.runner.static
    assert static.graphs is not None and eager.engine.runner.static.graphs is None
    assert static.graphs.stats["num_graphs"] == len(static.buffers.sizes) and static.graphs.stats["capture_s"] > 0
    got = [o.token_ids for o in graphed.generate(prompt_token_ids=prompts, sampling_params=params)]
    want = [o.token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    assert got == expected
    assert static.num_steps > 20


def test_seeded_sampling_is_the_same_with_and_without_graphs(tiny_reference):
    path, prompts, _ = tiny_reference
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    graphed = llm(path, 0, False).generate(prompt_token_ids=prompts, sampling_params=params)
    eager = llm(path, 0, True).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_overlapped_graph_steps_give_the_same_tokens(tiny_reference):
    """engine.overlap on the GPU (on by default with graphs): step n+1 replays before the host reads step
    n's samples; greedy and seeded tokens equal the graphs without overlap, and transformers' greedy."""
    path, prompts, expected = tiny_reference
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    overlapped, plain = llm(path, 0, False), llm(path, 0, False, async_scheduling=False)
    assert overlapped.engine.async_scheduling and not plain.engine.async_scheduling
    got = [o.token_ids for o in overlapped.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    assert got == [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    assert got == expected
    got = [o.token_ids for o in overlapped.generate(prompt_token_ids=prompts, sampling_params=seeded)]
    assert got == [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=seeded)]
    assert overlapped.engine.num_steps_launched_ahead > 20 and plain.engine.num_steps_launched_ahead == 0
    manager = overlapped.engine.manager
    assert manager.num_free_pages() == manager.num_total_pages()


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_replayed_logits_equal_the_eager_static_and_plan_steps(arch):
    _, ours, config = load_pair(arch)
    ours = ours.to(CUDA)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (5, 13, 22)]
    cache = PagedKV.for_config(config, B, device=CUDA)
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            ours(cache.batch([(r, prompt, 0)]))
    plan = copy.deepcopy(cache)
    steps = [(0, [7], 5), (1, [3, 9, 4], 13), (2, [1], 22)]
    with torch.inference_mode():
        expected = ours(plan.batch(steps))
    buffers = StaticStepBuffers(StepShape(4, 8, WIDTH, B, {g.name: g.window for g in cache.spec.groups}), CUDA)
    rope = ours.rope_table(WIDTH * B, CUDA)
    graphs = CudaGraphs(lambda n: static_forward(ours, buffers, n, rope, cache.kv), buffers.sizes,
                        torch.device(CUDA))
    graphs.capture()
    for r, tokens, start in steps:
        cache.prepare(r, start, start + len(tokens))
    size = buffers.fill([StepRequest(f"r{r}", t, s, cache.tables[r]) for r, t, s in steps])
    buffers.upload()
    replayed = graphs.replay(size)[:5].clone()
    assert relative_error(replayed, expected) < 1e-4
    assert torch.equal(replayed.argmax(-1), expected.argmax(-1))
    for group in cache.kv:
        torch.testing.assert_close(cache.kv[group], plan.kv[group], rtol=1e-4, atol=1e-5, equal_nan=True)
    # every size's logits are rows of one tensor (graph_runner): the largest's, shared by all sizes
    heads = {n: graphs.replay(n) for n in graphs.sizes}
    assert {t.data_ptr() for t in heads.values()} == {heads[max(graphs.sizes)].data_ptr()}
    assert all(t.shape[0] == n for n, t in heads.items())


def test_restaging_waits_for_the_last_upload_to_be_read():
    """upload() copies from pinned memory asynchronously; fill() right after it (no sync between) must
    not change what that copy sends. A large copy queued behind a busy stream makes the window wide."""
    shape = StepShape(64, 256, 64, B, {"full": None})
    buffers = StaticStepBuffers(shape, CUDA)
    first = [StepRequest(f"r{i}", [i + 1], 10 + i, {"full": [8 * i + k for k in range(8)]}) for i in range(8)]
    buffers.fill(first)
    expected = buffers.host.clone()
    busy = torch.randn(4096, 4096, device=CUDA)
    for _ in range(20):
        busy = busy @ busy / 64  # the stream is busy: the copy below waits behind these
    buffers.upload()
    buffers.fill([StepRequest("other", [99], 3, {"full": [5]})])  # must wait for the copy to read `first`
    torch.cuda.synchronize()
    assert torch.equal(buffers.flat.cpu(), expected)


def test_capture_names_its_attention_and_records_reserved_memory(tiny_reference, caplog):
    path = tiny_reference[0]
    with caplog.at_level(logging.INFO, logger="engine.gpu.graph_runner"):
        graphed = llm(path, 0, False)
    static = graphed.engine.runner.static
    assert static.attention == "triton"
    lines = [r.getMessage() for r in caplog.records if " tokens on cuda" in r.getMessage()]
    assert len(lines) == len(static.buffers.sizes) and all("triton attention" in line for line in lines)
    stats = static.graphs.stats
    assert stats["reserved_after"] >= stats["reserved_before"] > 0
    assert graphed.engine.stats()["graph_capture_reserved_bytes"] == stats["reserved_bytes"]


def test_mixed_steps_replay_the_decode_rows_and_keep_the_tokens(tiny_reference):
    """Prompts arriving every 4 steps: most steps mix a prefill chunk with decodes; their decode rows replay
    the graphs (>= 90% of decode rows on the static path) and the tokens equal eager's and transformers'."""
    path, prompts, expected = tiny_reference
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = {}
    for enforce_eager in (False, True):
        engine = LLM(path, device=CUDA, dtype="float32", tokens_per_block=8, max_num_seqs=4,
                     max_num_batched_tokens=24, enforce_eager=enforce_eager).engine
        got[enforce_eager] = run_with_arrivals(engine, prompts, params, every=4)
        stats = engine.stats()
        assert engine.runner.num_split_steps >= 5
        assert stats["num_static_decode_rows"] >= 0.9 * stats["num_decode_rows"] > 0
    assert got[False] == got[True]
    assert [got[False][f"r{i}"] for i in range(len(prompts))] == expected
