"""What the GPU path checks before it captures, on the CPU with the device type given: the attention a graph
would record (Triton, or the torch reference that gathers whole rows and is refused on CUDA unless asked),
``cuda:N`` validated and entered around capture and launches, and the config's device strings."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.config import EngineConfig
from engine.gpu.paged_attention import attention_path, check_attention_path
from engine.gpu.static_runner import device_context
from engine.runner import check_cuda_index


def test_the_reference_attention_is_refused_on_cuda_unless_asked():
    with pytest.raises(ValueError, match="allow_reference_attention"):
        check_attention_path("reference", "cuda", allow_reference=False)
    check_attention_path("reference", "cuda", allow_reference=True)
    check_attention_path("triton", "cuda", allow_reference=False)
    check_attention_path("reference", "cpu", allow_reference=False)  # the CPU's static path: tests


def test_the_attention_path_is_what_the_kernels_run_here():
    """tests/engine/gpu's conftest sets TRITON_INTERPRET: CPU tensors run Triton's interpreter."""
    assert attention_path("cpu") == "triton"
    assert attention_path(torch.device("meta")) == "reference"


def test_a_cuda_index_must_name_a_visible_device():
    check_cuda_index(torch.device("cuda"), 1)
    check_cuda_index(torch.device("cuda:1"), 2)
    with pytest.raises(ValueError, match=r"cuda:1 does not exist.*1 CUDA device"):
        check_cuda_index(torch.device("cuda:1"), 1)


def test_cuda_n_is_entered_as_the_current_device_and_the_cpu_enters_nothing():
    context = device_context(torch.device("cuda:1"))
    assert isinstance(context, torch.cuda.device) and context.idx == 1
    assert isinstance(device_context(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.parametrize("device", ["cuda:", "cudax", "cuda:one", "gpu"])
def test_malformed_devices_are_refused(device):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=device)


def test_well_formed_devices_and_the_reference_switch_are_accepted():
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:3"):
        assert EngineConfig(device=device).device == device
    assert EngineConfig(allow_reference_attention=True).allow_reference_attention
    assert not EngineConfig().allow_reference_attention
