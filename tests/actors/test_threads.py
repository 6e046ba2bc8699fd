"""A worker's torch threads: as configured, else the CPUs Ray assigned it (num_cpus), else one."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.worker_base import resolve_torch_threads
from bench.common import start_ray


def test_configured_threads_win_and_outside_ray_is_one():
    assert resolve_torch_threads(3) == 3
    if not ray.is_initialized():
        assert resolve_torch_threads(None) == 1


@pytest.fixture(scope="module")
def ray_session():
    start_ray(num_cpus=2)
    yield
    ray.shutdown()


@ray.remote
def threads_in_task(configured):
    torch.set_num_threads(resolve_torch_threads(configured))
    return torch.get_num_threads()


@pytest.mark.parametrize(("num_cpus", "configured", "expected"), [(2, None, 2), (1, None, 1), (0, None, 1),
                                                                   (0.5, None, 1), (2, 1, 1)])
def test_threads_follow_the_cpus_ray_assigned(ray_session, num_cpus, configured, expected):
    assert ray.get(threads_in_task.options(num_cpus=num_cpus).remote(configured)) == expected
