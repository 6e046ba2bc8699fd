"""Overlapped decode steps (engine.overlap), run on the CPU over the static path: step n+1 is launched
before the host reads step n's samples. The tokens, logprobs and finish reasons equal the ordinary
step's for every request (greedy and seeded, stopped by a stop id, by length, aborted, arriving late,
under page pressure), the steps really were launched ahead, and an ended request's pages stay bound
exactly while a launched step still writes them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.gpu import paged_attention
from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape
from engine.outputs import FinishReason
from tests.engine.engine_fixtures import make_engine, tiny_model  # noqa: F401


@pytest.fixture(autouse=True)
def torch_attention(monkeypatch):
    """The static step's torch reference attention, also where the suite's process interprets Triton
    (tests/engine/gpu sets TRITON_INTERPRET): both runs of a comparison take the same path, and the
    kernels have their own tests there."""
    monkeypatch.setattr(paged_attention, "_runs_triton", lambda *tensors: False)


def engine_for(model, overlap: bool, **kwargs):
    kwargs = {"tokens_per_block": 8, "max_model_len": 160, "max_num_seqs": 4, **kwargs}
    return make_engine(model, use_static_buffers=True, async_scheduling=overlap, **kwargs)


def prompts_for(vocab: int, lengths=(5, 13, 22, 9)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def drive(engine, prompts, params, *, late: dict[int, int] | None = None, aborts: dict[int, str] | None = None,
          max_steps: int = 500) -> dict[str, dict]:
    """Run to the end; request i joins at step ``late.get(i, 0)``; ``aborts[k]`` is aborted before step k.
    Returns per request id its tokens, logprobs and finish reason; every page is free at the end."""
    late, aborts = late or {}, aborts or {}
    out = {f"r{i}": {"tokens": [], "logprobs": [], "reason": None} for i in range(len(prompts))}
    for k in range(max_steps):
        for i, prompt in enumerate(prompts):
            if late.get(i, 0) == k:
                engine.add_request(f"r{i}", prompt, params[i])
        if k in aborts:
            engine.abort(aborts[k])
            out[aborts[k]]["reason"] = FinishReason.ABORT
        if k > max(late.values(), default=0) and not engine.has_unfinished():
            break
        for update in engine.step():
            got = out[update.request_id]
            assert got["reason"] is None, f"{update.request_id}: an update after it ended"
            got["tokens"] += update.new_token_ids
            got["logprobs"] += update.logprobs or []
            got["reason"] = update.finish_reason
            engine.manager.check_integrity()
    assert not engine.has_unfinished()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
    return out


def test_the_step_reads_its_first_token_from_the_previous_steps_samples():
    shape = StepShape(max_num_seqs=3, max_tokens=3, table_width=2, tokens_per_block=4, windows={"full": None})
    buffers = StaticStepBuffers(shape, "cpu")
    buffers.keep_samples(torch.tensor([41, 42, 43], dtype=torch.int32))
    buffers.fill([StepRequest("a", [7], 0, {"full": [0]}), StepRequest("b", [0], 1, {"full": [1]}, sampled_from=2),
                  StepRequest("c", [0], 2, {"full": [2]}, sampled_from=0)])
    buffers.upload()
    assert buffers.input_ids(3).tolist() == [7, 43, 41]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_overlapped_steps_give_the_ordinary_steps_tokens(tiny_model, data):
    """r0 runs 12+ tokens from the start (steps are launched ahead); the others vary. A seeded draw on the
    static path differs from the host path's (engine.gpu.sampling), and a late arrival turns a step into a
    mixed one (host path) in one run and not in the other: late arrivals only where every request is greedy."""
    vocab = tiny_model.hf_config.vocab_size
    prompts = prompts_for(vocab)
    is_sampled = [data.draw(st.booleans(), label=f"r{i} sampled") for i in range(len(prompts))]
    params = [SamplingParams(
        max_tokens=data.draw(st.integers(12 if i == 0 else 1, 24), label=f"r{i} max_tokens"), ignore_eos=True,
        temperature=0.8 if is_sampled[i] else 0.0, top_k=40 if is_sampled[i] else 0, seed=100 + i,
        logprobs=data.draw(st.sampled_from([None, 2]), label=f"r{i} logprobs")) for i in range(len(prompts))]
    plain = drive(engine_for(tiny_model, False), prompts, params)
    # stop ids drawn from what r1.. generate: they end mid-run, found only when their step is collected
    stops = [None] + [data.draw(st.sampled_from([None, *plain[f"r{i}"]["tokens"]]), label=f"r{i} stop")
                      for i in range(1, len(prompts))]
    params = [p if s is None else dataclasses.replace(p, stop_token_ids=(s,)) for p, s in zip(params, stops)]
    late = {} if any(is_sampled) else {i: data.draw(st.integers(0, 6), label=f"r{i} joins")
                                      for i in range(1, len(prompts))}
    plain = drive(engine_for(tiny_model, False), prompts, params, late=late)
    engine = engine_for(tiny_model, True)
    overlapped = drive(engine, prompts, params, late=late)
    assert_same(overlapped, plain)
    assert engine.num_steps_launched_ahead > 0


def assert_same(got: dict, want: dict) -> None:
    """Tokens, finish reasons and logprobs' ids equal; logprob values to float32 rounding (a step's padded
    size differs between the runs where a stopped request's row was computed and dropped)."""
    assert {r: (v["tokens"], v["reason"]) for r, v in got.items()} == \
        {r: (v["tokens"], v["reason"]) for r, v in want.items()}
    for r in want:
        pairs = list(zip(got[r]["logprobs"], want[r]["logprobs"], strict=True))
        for a, b in pairs:
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_a_stopped_requests_pages_stay_bound_until_the_step_launched_after_it_is_collected(tiny_model):
    vocab = tiny_model.hf_config.vocab_size
    prompts = prompts_for(vocab)[:2]
    free_run = drive(engine_for(tiny_model, False), prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * 2)
    stop = free_run["r0"]["tokens"][5]
    stop_at = free_run["r0"]["tokens"].index(stop)
    engine = engine_for(tiny_model, True)
    engine.add_request("r0", prompts[0], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,)))
    engine.add_request("r1", prompts[1], SamplingParams(max_tokens=12, ignore_eos=True))
    seen, ended = [], False
    for _ in range(40):
        updates = engine.step()
        seen += [t for u in updates if u.request_id == "r0" for t in u.new_token_ids]
        if any(u.request_id == "r0" and u.finish_reason == FinishReason.STOP for u in updates):
            ended = True
            break
    assert ended and seen == free_run["r0"]["tokens"][:stop_at + 1]
    # the step launched after r0's last one holds a row of r0 (its input: r0's stop token, on the device)
    assert "r0" in engine._in_flight.request_ids
    assert engine.manager.has_request("r0"), "r0's pages were freed while a launched step writes them"
    assert not engine.abort("r0")  # a late abort of an ended request frees nothing early either
    assert engine.manager.has_request("r0")
    updates = engine.step()  # collects that step: r0's row is dropped, its pages go back
    assert "r0" not in {u.request_id for u in updates}
    assert not engine.manager.has_request("r0")
    finish(engine)


def finish(engine) -> None:
    """Step to the end; then every page is free."""
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_an_abort_between_overlapped_steps_frees_the_pages_after_the_step_using_them(tiny_model):
    vocab = tiny_model.hf_config.vocab_size
    prompts = prompts_for(vocab)[:3]
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * 3
    plain = drive(engine_for(tiny_model, False), prompts, params, aborts={6: "r1"})
    engine = engine_for(tiny_model, True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i])
    tokens = {f"r{i}": [] for i in range(3)}
    for _ in range(6):
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
    assert "r1" in engine._in_flight.request_ids  # the abort hits a request with a step in flight
    assert engine.abort("r1")
    assert engine.manager.has_request("r1")  # still written by the launched step
    for update in engine.step():
        assert update.request_id != "r1"
        tokens[update.request_id] += update.new_token_ids
    assert not engine.manager.has_request("r1")
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
    assert tokens["r1"] == plain["r1"]["tokens"]
    assert tokens["r0"] == plain["r0"]["tokens"] and tokens["r2"] == plain["r2"]["tokens"]


def test_overlap_under_page_pressure_preempts_as_the_ordinary_step_does(tiny_model):
    vocab = tiny_model.hf_config.vocab_size
    prompts = prompts_for(vocab, lengths=(20, 30, 25, 28))
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 4
    tight = {"num_pages": 24, "max_model_len": 96}
    plain_engine = engine_for(tiny_model, False, **tight)
    plain = drive(plain_engine, prompts, params)
    engine = engine_for(tiny_model, True, **tight)
    overlapped = drive(engine, prompts, params)
    assert plain_engine.scheduler.num_preemptions > 0 and engine.scheduler.num_preemptions > 0
    assert engine.num_steps_launched_ahead > 0
    assert_same(overlapped, plain)


def test_async_scheduling_needs_the_static_path_and_no_drafts(tiny_model):
    with pytest.raises(ValueError, match="static decode path"):
        make_engine(tiny_model, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative"):
        make_engine(tiny_model, use_static_buffers=True, async_scheduling=True, max_draft_len=2)
    assert not make_engine(tiny_model, use_static_buffers=True).async_scheduling  # None: off without graphs


@pytest.mark.parametrize("abort_first", [True, False])
def test_a_failed_collect_with_a_step_in_flight_leaks_no_page(tiny_model, monkeypatch, abort_first):
    """The fault hits the collect of a launched step: with an aborted request's pages waiting for it
    (abort_first), or with the next step already launched ahead. After the failure and the loop's abort of
    what was running (actors.engine_loop's _fail_all), nothing is in flight and every page is free."""
    vocab = tiny_model.hf_config.vocab_size
    prompts = prompts_for(vocab)[:3]
    engine = engine_for(tiny_model, True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    if abort_first:
        assert engine.abort("r1") and engine._in_flight.frees == ["r1"]
    launched = engine.num_steps_launched_ahead

    def failing_collect(step):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "collect", failing_collect)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.num_steps_launched_ahead == launched + (0 if abort_first else 1)
    assert engine._in_flight is None
    assert not engine.manager.has_request("r1") if abort_first else engine.manager.has_request("r1")
    monkeypatch.undo()
    for request in list(engine.scheduler.running):
        engine.abort(request.request_id)
    assert not engine.has_unfinished()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
