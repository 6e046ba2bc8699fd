"""One windserve-tiny load shared by the engine tests, and a helper to drive an engine."""

from __future__ import annotations

import os

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.worker_model import WorkerModel


@pytest.fixture(scope="session")
def tiny_model() -> WorkerModel:
    torch.set_num_threads(1)
    return WorkerModel.load(EngineConfig(device="cpu"))


def make_engine(model: WorkerModel, role: str = "both", **kwargs) -> LLMEngine:
    kwargs.setdefault("device", "cpu")
    return LLMEngine(EngineConfig(**kwargs), role=role, model=model)


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      max_steps: int = 5000) -> dict[str, list[int]]:
    """Token ids per request id ``r0, r1, ...``; every page must be free at the end."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, p)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished = set()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            out[update.request_id].extend(update.new_token_ids)
            engine.manager.check_integrity()
            if update.finish_reason is not None:
                finished.add(update.request_id)
    assert finished == set(out), f"unfinished requests: {set(out) - finished}"
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
    return out


def built_kernel(accessor):
    """A native kernel (``engine.native``'s accessor called), or the test skipped; in CI a failed build fails."""
    built = accessor()
    if built is None:
        if os.environ.get("CI"):
            pytest.fail("the native kernels did not build in CI (a C++ compiler and ninja are expected)")
        pytest.skip("the native kernels did not build on this machine")
    return built
