"""bench.serve_path's pure parts: the servers it compares, and the engine step it divides the ITL by.

The served runs themselves take minutes and a quiet machine (docs/benchmarks.md); here, without Ray: every
mode's config is one the app accepts and builds into the deployments the mode names, and the engine's
step is measured at the contexts the served requests decode at.
"""

from __future__ import annotations

import pytest

from app.config import AppConfig
from app.serve_app import build_app_with
from bench import engine_alone, serve_path
from bench.serve.compare import load_serve_config
from bench.serve.trace import make_trace
from engine.model_registry import resolve_model_path
from engine.tokenizer import Tokenizer


def mode_args(mode: str) -> dict:
    application, _ = load_serve_config(serve_path.CONFIG)
    return {**application["args"], **serve_path.OVERRIDES[mode]}


@pytest.mark.parametrize("mode", list(serve_path.OVERRIDES))
def test_every_mode_is_a_config_the_app_builds(mode):
    config = AppConfig.model_validate(mode_args(mode))
    ingress = build_app_with(mode_args(mode))._bound_deployment
    assert ingress.name == "Ingress"
    bound = {arg._bound_deployment.name for arg in [*ingress.init_args[1:], *ingress.init_kwargs.values()]}
    expected = {"disagg": {"WorkerStats", "ContextWorker", "GenerationWorker"},
                "aggregated": {"WorkerStats", "AggregatedWorker"},
                "aggregated-ray": {"WorkerStats", "AggregatedWorker"},
                "aggregated-in-ingress": {"WorkerStats"}}[mode]
    assert bound == expected
    assert (config.mode, config.engine_in_ingress) == {"disagg": ("disagg", False)}.get(
        mode, ("aggregated", mode == "aggregated-in-ingress"))
    if config.mode == "aggregated":
        assert config.torch_threads == 2  # issue 29's aggregated run
    assert config.handle_transport == ("ray" if mode == "aggregated-ray" else "grpc")


@pytest.mark.parametrize("size", ["full", "quick"])
def test_the_engine_step_is_measured_at_the_served_prompts_length(size):
    sizes = serve_path.SIZES[size]
    tokenizer = Tokenizer(resolve_model_path(serve_path.MODEL))
    trace = make_trace(sizes["requests"][1], sizes["input_len"], sizes["output_len"], spread=0.0, seed=1)
    lengths = [len(tokenizer.encode(spec.prompt)) for spec in trace]
    assert serve_path.served_prompt_len(sizes) == round(sum(lengths) / len(lengths))
    assert serve_path.served_prompt_len(sizes) < sizes["input_len"]  # characters, not tokens: ~235 of 400


def test_itl_over_step():
    assert serve_path.itl_over_step(12.0, 10.0) == pytest.approx(1.2)
    assert serve_path.itl_over_step(None, 10.0) is None
    assert serve_path.itl_over_step(12.0, None) is None  # --no-engine-step


def process_state(pid: int) -> str:
    """The one-letter state in /proc/<pid>/stat: T while stopped."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.mark.parametrize("fails", [False, True])
def test_the_engine_alone_is_measured_with_the_serving_processes_stopped_then_resumed(fails):
    import subprocess
    import sys

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    seen = []

    def ms(threads: int) -> float:
        seen.append((threads, [process_state(p.pid) for p in spinners]))
        if fails:
            raise RuntimeError("the engine failed mid-measurement")
        return 9.5

    alone = object.__new__(engine_alone.AloneStep)  # no engine: ms() is the measurement under test here
    alone.cpu_s = alone.wall_s = 0.0
    alone.ms = ms
    try:
        if fails:
            with pytest.raises(RuntimeError):
                alone.ms_with_stopped([spinners[0].pid, gone.pid, spinners[1].pid])
        else:
            assert alone.ms_with_stopped([spinners[0].pid, gone.pid, spinners[1].pid]) == 9.5
        assert seen == [(2, ["T", "T"])]  # both stopped while the step was measured (a dead pid skipped)
        assert all(process_state(p.pid) != "T" for p in spinners)  # and running again after, raise or not
        assert alone.wall_s > 0.0
    finally:
        for p in spinners:
            p.kill()
            p.wait()
