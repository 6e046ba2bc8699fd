"""One windserve-tiny load shared by the engine tests, and a helper to drive an engine."""

from __future__ import annotations

import os
import shutil

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
    """A native kernel (``engine.native``'s accessor called), or the test skipped, only where no build can
    happen: ``WINDSERVE_NATIVE=0`` (the documented opt-out) or no C++ compiler / ninja on this machine.
    Where both exist the build must have succeeded: a broken build fails here instead of hiding as skips."""
    built = accessor()
    if built is not None:
        return built
    if os.environ.get("WINDSERVE_NATIVE", "1") == "0":
        pytest.skip("the native kernels are turned off (WINDSERVE_NATIVE=0)")
    missing = native_toolchain_missing()
    if missing:
        pytest.skip(f"the native kernels cannot build on this machine: no {missing}")
    pytest.fail("the native kernels did not build although a C++ compiler and ninja exist (see the warning "
                "engine.native logged)")


def native_toolchain_missing() -> str:
    """What torch's extension builder lacks here ("" if nothing): its C++ compiler ($CXX or c++), ninja."""
    from torch.utils import cpp_extension

    if shutil.which(cpp_extension.get_cxx_compiler()) is None:
        return f"C++ compiler ({cpp_extension.get_cxx_compiler()})"
    return "" if cpp_extension.is_ninja_available() else "ninja"
