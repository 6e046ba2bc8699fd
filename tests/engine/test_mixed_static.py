"""Mixed steps on the static path (engine.runner): a step that carries prefill chunks beside decodes runs
the decodes over the fixed buffers (a graph on a GPU) and the chunks through the plan path, two forwards.
Under steady arrivals the tokens equal the plan path's and transformers', and nearly every decode row
takes the static path (``stats()``' num_static_decode_rows over num_decode_rows)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.engine_fixtures import make_engine, tiny_model  # noqa: F401
from tests.engine.test_engine_vs_transformers import reference  # noqa: F401


def run_with_arrivals(engine, prompts: list[list[int]], params, every: int) -> dict[str, list[int]]:
    """One prompt arrives every ``every`` steps (its prefill chunks share steps with the decodes running)."""
    out = {f"r{i}": [] for i in range(len(prompts))}
    params = params if isinstance(params, list) else [params] * len(prompts)
    for step in range(2000):
        i, is_arrival = divmod(step, every)
        if is_arrival == 0 and i < len(prompts):
            engine.add_request(f"r{i}", prompts[i], params[i])
        elif i >= len(prompts) and not engine.has_unfinished():
            break
        for update in engine.step():
            out[update.request_id].extend(update.new_token_ids)
    assert not engine.has_unfinished()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
    return out


@pytest.mark.parametrize("draft_len", [0, 3])
def test_mixed_steps_match_the_plan_path_and_transformers_under_arrivals(tiny_model, reference, draft_len):
    prompts, expected = reference
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = {}
    for is_static in (False, True):
        engine = make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len, max_model_len=256,
                             max_num_seqs=4, max_num_batched_tokens=24, use_static_buffers=is_static)
        got[is_static] = run_with_arrivals(engine, prompts, params, every=4)
        if is_static:
            stats, runner = engine.stats(), engine.runner
            assert runner.num_split_steps >= 5, "no prefill chunk shared a step with decodes"
            assert stats["num_static_decode_rows"] >= 0.9 * stats["num_decode_rows"] > 0
            assert stats["graph_capture_reserved_bytes"] == 0  # the CPU captures nothing
    assert got[True] == got[False]
    for i, want in enumerate(expected):
        assert got[True][f"r{i}"] == want, f"prompt of {len(prompts[i])} tokens diverges"


def test_seeded_mixed_steps_draw_as_steps_without_prefills(tiny_model, reference):
    """The decode rows of a mixed step sample on the device, a chunk's last row on the host: both draw by
    (seed, output index), so the tokens equal those of requests served one at a time (no mixed step)."""
    prompts = reference[0][:4]
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=5 + i, ignore_eos=True)
              for i in range(len(prompts))]
    got = {}
    for max_num_seqs in (1, 4):
        engine = make_engine(tiny_model, tokens_per_block=8, max_model_len=256, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=16, use_static_buffers=True)
        got[max_num_seqs] = run_with_arrivals(engine, prompts, params, every=3)
        assert (engine.runner.num_split_steps >= 3) == (max_num_seqs == 4)
    assert got[1] == got[4]
