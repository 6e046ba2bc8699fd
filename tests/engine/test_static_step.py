"""The static (fixed-buffer) decode/verify step, run eagerly on the CPU: its logits equal the plan-based
step's and transformers' at the same positions (float32), its padded rows write no page slot, and whole
engines with the static path forced give today's greedy tokens (and transformers'), with and without drafts.

The paged kernels are engine.gpu's torch references here (Triton's interpreter where a test process
set TRITON_INTERPRET, as tests/engine/gpu does): the same semantics either way.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine import SamplingParams
from engine.gpu.sampling import SamplingRows, accepted_drafts, sample_tokens, top_logprobs
from engine.gpu.static_runner import static_forward
from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401
from tests.engine.helpers import PagedKV, load_pair, relative_error
from tests.engine.test_engine_vs_transformers import reference  # noqa: F401

B = 4
WIDTH = 16  # ordinals per block table: 64 positions


def prompts_for(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 13, 22)]


def buffers_for(cache: PagedKV, max_tokens: int = 8) -> StaticStepBuffers:
    windows = {g.name: g.window for g in cache.spec.groups}
    return StaticStepBuffers(StepShape(4, max_tokens, WIDTH, B, windows), "cpu")


def run_static(model, cache: PagedKV, steps: list[tuple[int, list[int], int]]) -> tuple[torch.Tensor, int]:
    """Bind pages as the plan path would, stage ``steps`` (request, tokens, first position), run padded."""
    for r, tokens, start in steps:
        cache.prepare(r, start, start + len(tokens))
    buffers = buffers_for(cache)
    size = buffers.fill([StepRequest(f"r{r}", tokens, start, cache.tables[r]) for r, tokens, start in steps])
    buffers.upload()
    rope = model.rope_table(WIDTH * B, "cpu")
    with torch.inference_mode():
        return static_forward(model, buffers, size, rope, cache.kv), size


def slots_written(cache: PagedKV, steps) -> dict[str, set[tuple[int, int]]]:
    """(page, slot) of every live token, per group."""
    return {g: {(cache.tables[r][g][p // B], p % B) for r, tokens, s in steps for p in range(s, s + len(tokens))}
            for g in cache.kv}


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "qwen2_sliding", "gemma3"])
def test_static_step_matches_the_plan_step_and_transformers(arch):
    reference_model, ours, config = load_pair(arch)
    prompts = prompts_for(config.vocab_size)
    plan = PagedKV.for_config(config, B)
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            ours(plan.batch([(r, prompt, 0)]))
    static = copy.deepcopy(plan)
    # a decode step for r0 and r2, a verify step (1 + 2 drafts) for r1: 5 tokens, padded to 8
    steps = [(0, [7], 5), (1, [3, 9, 4], 13), (2, [1], 22)]
    with torch.inference_mode():
        expected = ours(plan.batch(steps))
    for r, tokens, start in steps:  # binds (and releases, NaN-filled) pages as the plan step did
        static.prepare(r, start, start + len(tokens))
    before = {g: t.clone() for g, t in static.kv.items()}
    logits, size = run_static(ours, static, steps)
    assert size == 8
    assert relative_error(logits[:5], expected) < 1e-5
    assert torch.equal(logits[:5].argmax(-1), expected.argmax(-1))
    for group, written in slots_written(static, steps).items():
        changed = ~((static.kv[group] == before[group]) | (static.kv[group].isnan() & before[group].isnan()))
        pages_slots = {(int(p), int(s)) for p, _, _, s in changed.any(dim=(4, 5)).nonzero().tolist()}
        assert pages_slots == written, f"group {group}: padded rows wrote outside the live slots"
        torch.testing.assert_close(static.kv[group], plan.kv[group], rtol=1e-4, atol=1e-5, equal_nan=True)
    with torch.no_grad():
        rows = iter(range(5))
        for r, tokens, start in steps:
            full = reference_model(torch.tensor([prompts[r] + tokens])).logits[0, start:]
            mine = logits[[next(rows) for _ in tokens]]
            assert relative_error(mine, full) < 1e-4


def test_a_padded_step_after_a_larger_one_gives_the_same_logits():
    """Buffers refilled for a smaller step keep nothing of the larger one: same logits as fresh buffers."""
    _, ours, config = load_pair("qwen2_sliding")
    prompts = prompts_for(config.vocab_size)
    cache = PagedKV.for_config(config, B)
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            ours(cache.batch([(r, prompt, 0)]))
    fresh_cache = copy.deepcopy(cache)
    reused = buffers_for(cache)
    rope = ours.rope_table(WIDTH * B, "cpu")
    big = [(0, [7, 8], 5), (1, [3, 9, 4], 13), (2, [1], 22)]
    small = [(1, [3], 13), (0, [7], 5), (2, [1], 22)]  # 3 tokens in a bucket of 4
    for steps in (big, small):
        for r, tokens, start in steps:
            cache.prepare(r, start, start + len(tokens))
        size = reused.fill([StepRequest(f"r{r}", t, s, cache.tables[r]) for r, t, s in steps])
        reused.upload()
        with torch.inference_mode():
            after_big = static_forward(ours, reused, size, rope, cache.kv)[:3]
    fresh, size = run_static(ours, fresh_cache, small)
    assert size == 4
    assert torch.equal(after_big, fresh[:3])


@pytest.mark.parametrize("draft_len", [0, 3])
def test_engine_with_the_static_path_forced_matches_eager_and_transformers(tiny_model, reference, draft_len):
    prompts, expected = reference
    prompts, expected = prompts[:4], expected[:4]  # the 200-token prompt adds nothing to a decode step
    got = {}
    for is_static in (False, True):
        engine = make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len, max_model_len=160,
                             max_num_seqs=4, use_static_buffers=is_static)
        got[is_static] = run_to_completion(engine, prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        assert (engine.runner.static is not None) == is_static
        if is_static:
            assert engine.runner.static.num_steps > 20  # the decode steps ran the static path
    assert got[True] == got[False]
    for i, want in enumerate(expected):
        assert got[True][f"r{i}"] == want, f"prompt of {len(prompts[i])} tokens diverges"


def test_seeded_static_sampling_does_not_depend_on_drafts_or_batch(tiny_model, reference):
    """Device draws are keyed by (seed, output index): drafts verified by drawing, alone or in a batch,
    the same tokens come out."""
    prompts = reference[0][:3]
    params = [SamplingParams(max_tokens=32, temperature=0.3, top_k=50, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    got = {}
    for draft_len in (0, 3):
        engine = make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len, max_model_len=160,
                             max_num_seqs=4, use_static_buffers=True)
        got[draft_len] = run_to_completion(engine, prompts, params)
        assert draft_len == 0 or engine.num_drafts_proposed > 0  # verify steps ran (acceptance varies with the
        # draft-length policy, which weighs step times)
    alone = make_engine(tiny_model, tokens_per_block=8, max_model_len=160, max_num_seqs=4, use_static_buffers=True)
    assert got[0] == got[3]
    assert run_to_completion(alone, prompts[1:2], params[1:2])["r0"] == got[0]["r1"]
    assert len(set(map(tuple, got[0].values()))) == 3


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "qwen2_sliding", "gemma3"])
def test_the_captured_step_reads_no_value_on_the_host(arch):
    """A CUDA graph's capture refuses any host sync (.item(), .tolist(), a data-dependent shape, a Python branch
    on a tensor), and the step's sampling may read back only once. Both run here on meta tensors, which have
    shapes and no data, so any such read raises: the forward a graph captures (the references' attention, as
    on a GPU without Triton) and the draws after it (temperature, top-k/top-p, drafts, logprobs)."""
    _, ours, config = load_pair(arch)
    cache = PagedKV.for_config(config, B)
    steps = [(0, [7], 5), (1, [3, 9, 4], 13), (2, [1], 22)]
    for r, tokens, start in steps:
        cache.prepare(r, start, start + len(tokens))
    windows = {g.name: g.window for g in cache.spec.groups}
    buffers = StaticStepBuffers(StepShape(4, 8, WIDTH, B, windows), "meta")
    size = buffers.fill([StepRequest(f"r{r}", tokens, start, cache.tables[r]) for r, tokens, start in steps])
    buffers.upload()
    model = copy.deepcopy(ours).to("meta")
    with torch.inference_mode():
        logits = static_forward(model, buffers, size, model.rope_table(WIDTH * B, "meta"),
                                {group: pages.to("meta") for group, pages in cache.kv.items()})
        assert logits.device.type == "meta" and logits.shape == (size, config.vocab_size)
        view = buffers.token_view
        rows = SamplingRows(buffers.float_view("temperature", size), view("top_k", size),
                            buffers.float_view("top_p", size), *buffers.seeds(size), view("counters", size))
        for is_greedy, is_filtered in ((True, False), (False, False), (False, True)):
            ids = sample_tokens(logits, rows, is_greedy=is_greedy, is_filtered=is_filtered)
            assert ids.device.type == "meta" and ids.shape == (size,)
        accepted = accepted_drafts(ids, view("input_ids", size), view("token_offsets", size), view("table_rows", size),
                                   len(steps))
        chosen, values, top_ids = top_logprobs(logits, ids, 3)
    assert accepted.shape == (len(steps),) and values.shape == top_ids.shape == (size, 3)
    assert chosen.device.type == "meta"


@pytest.mark.parametrize("top_k", [0, 40])
def test_a_seeded_request_draws_the_same_tokens_whether_its_steps_are_static_or_mixed(tiny_model, reference, top_k):
    """With the static path, a's decodes sample on the device (counter-based noise), alone or in a step
    split beside another request's prefill chunk (engine.runner), whose first token the host samples: both
    draw from (seed, output index), so a seeded request's tokens do not depend on what arrives beside it."""
    prompts = reference[0]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=top_k, seed=7, ignore_eos=True)
    alone = make_engine(tiny_model, tokens_per_block=8, max_model_len=256, max_num_seqs=4, use_static_buffers=True)
    want = run_to_completion(alone, prompts[:1], params)["r0"]
    assert alone.runner.num_forward_passes == alone.runner.static.num_steps + 1  # one prefill, then static steps
    busy = make_engine(tiny_model, tokens_per_block=8, max_model_len=256, max_num_seqs=4, use_static_buffers=True,
                       max_num_batched_tokens=64)
    busy.add_request("a", prompts[0], params)
    got, others = [], iter(prompts[1:4])
    for k in range(200):
        if k % 5 == 2:  # a prompt arrives every 5 steps: its prefill chunks share "a"'s decode steps
            prompt = next(others, None)
            if prompt is not None:
                busy.add_request(f"b{k}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        if not busy.has_unfinished():
            break
        got += [t for u in busy.step() if u.request_id == "a" for t in u.new_token_ids]
    assert busy.runner.num_split_steps >= 3, "the other prompts' prefills did not share steps with a's decodes"
    assert got == want
