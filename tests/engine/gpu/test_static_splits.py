"""Split-KV on the static (graph) path: the plan a runner fixes per padded size and layer group, and a
static step that runs it (Triton's interpreter here, compiled on a GPU) passes each group's count to the
kernel and gives the logits of the unsplit step."""

from __future__ import annotations

import copy

import pytest
import torch

import engine.models.decoder as decoder
from engine.gpu import default_num_splits
from engine.gpu.paged_attention import _runs_triton
from engine.gpu.static_runner import split_plan, static_forward
from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape
from engine.gpu.triton_build import is_interpreted
from tests.engine.helpers import PagedKV, load_pair, relative_error

B, WIDTH = 4, 16


def test_the_plan_splits_long_reads_of_small_steps_only():
    windows, heads = {"sliding": 128, "full": None}, {"sliding": 3, "full": 3}
    plan = split_plan([1, 2, 8, 64], windows, heads, 8192, num_sms=132)
    assert plan[1] == {"sliding": 1, "full": default_num_splits(1, 3, 8192, 132)} and plan[1]["full"] == 16
    assert plan[8]["full"] == default_num_splits(8, 3, 8192, 132) > 1
    assert plan[64] == {"sliding": 1, "full": 1}  # 192 programs already fill 132 multiprocessors
    assert split_plan([1, 2], windows, heads, 8192, num_sms=None) == {}  # the CPU: no splits


@pytest.mark.skipif(not is_interpreted() and not torch.cuda.is_available(),
                    reason="needs Triton (interpreted or on a GPU)")
def test_a_static_step_runs_its_split_plan_and_matches_the_unsplit_step(monkeypatch):
    device = "cpu" if is_interpreted() else "cuda"
    assert _runs_triton(torch.empty(1, device=device), torch.empty(1, device=device))  # the kernel, not the
    # torch reference (which has no splits and would match whatever the count)
    _, ours, config = load_pair("gpt_oss")  # sliding and full groups, sinks
    ours = ours.to(device)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (37, 50)]
    cache = PagedKV.for_config(config, B, device=device)
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            ours(cache.batch([(r, prompt, 0)]))
    steps = [(0, [7], 37), (1, [3], 50)]
    for r, tokens, start in steps:
        cache.prepare(r, start, start + len(tokens))
    seen = []
    real = decoder.paged_decode_attention

    def recording(*args, **kwargs):
        seen.append(kwargs["num_splits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(decoder, "paged_decode_attention", recording)
    logits = {}
    for name, splits in (("unsplit", None), ("split", {g.name: 3 for g in cache.spec.groups})):
        kv = copy.deepcopy(cache)
        buffers = StaticStepBuffers(StepShape(4, 4, WIDTH, B, {g.name: g.window for g in kv.spec.groups}), device)
        size = buffers.fill([StepRequest(f"r{r}", t, s, kv.tables[r]) for r, t, s in steps])
        buffers.upload()
        with torch.inference_mode():
            logits[name] = static_forward(ours, buffers, size, ours.rope_table(WIDTH * B, device), kv.kv, splits)[:2]
    num_layers = config.num_hidden_layers
    assert seen == [1] * num_layers + [3] * num_layers
    assert relative_error(logits["split"].cpu(), logits["unsplit"].cpu()) < 1e-5
    assert torch.equal(logits["split"].argmax(-1), logits["unsplit"].argmax(-1))
