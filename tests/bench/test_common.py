"""bench.common's helpers that touch process-wide state: Ray start-up, torch threads, the RNG."""

from __future__ import annotations

import os

import pytest
import ray
import torch

from bench import common

TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


class FakeRay:
    """Stands in for ``ray.init`` / ``ray.shutdown``: fails with the given errors, then starts."""

    def __init__(self, errors: list[Exception], is_running: bool = False) -> None:
        self.errors = list(errors)
        self.is_running = is_running
        self.calls: list[str] = []

    def init(self, **kwargs) -> None:
        self.calls.append(f"init {sorted(kwargs.items())}")
        if self.errors:
            raise self.errors.pop(0)
        self.is_running = True

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.is_running = False


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    def install(errors: list[Exception], is_running: bool = False) -> FakeRay:
        fake = FakeRay(errors, is_running)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(ray, "is_initialized", lambda: fake.is_running)
        monkeypatch.setattr(common.time, "sleep", lambda s: None)
        return fake

    return install


def test_start_ray_retries_a_startup_timeout_and_passes_its_arguments(fake_ray):
    fake = fake_ray([TIMEOUT])
    common.start_ray(address="local", num_cpus=2)
    init = "init [('address', 'local'), ('include_dashboard', False), ('log_to_driver', False), ('num_cpus', 2)]"
    assert fake.calls == [init, "shutdown", init] and fake.is_running


def test_start_ray_gives_up_after_its_attempts(fake_ray):
    fake = fake_ray([TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match="timed out during startup"):
        common.start_ray(attempts=2)
    assert [c.split()[0] for c in fake.calls] == ["init", "shutdown", "init", "shutdown"]


def test_start_ray_raises_other_errors_at_once_and_leaves_a_running_ray_alone(fake_ray):
    fake = fake_ray([RuntimeError("Maybe you called ray.init twice by accident?")], is_running=True)
    with pytest.raises(RuntimeError, match="twice"):
        common.start_ray()
    assert len(fake.calls) == 1 and fake.is_running  # no retry, no shutdown of the caller's Ray


def test_torch_threads_is_restored_even_on_error():
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    with pytest.raises(ValueError), common.torch_threads(wanted):
        assert torch.get_num_threads() == wanted
        raise ValueError
    assert torch.get_num_threads() == before


def test_build_gptoss_model_is_seeded_and_leaves_the_global_rng_alone(tmp_path):
    from safetensors.torch import load_file

    small = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=16, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1)
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    weights = [load_file(f"{common.build_gptoss_model(str(tmp_path / name), **small)}/model.safetensors")
               for name in ("a", "b")]
    assert torch.equal(torch.rand(3), expected_next)  # the caller's random stream continues where it was
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # seed 0 both times


def test_machine_info_names_the_cpu_and_the_flags_that_pick_kernels(tmp_path, monkeypatch):
    """The CPU's model and, of its flags, those our kernels and oneDNN choose by (AVX2, AVX-512, bf16, AMX)."""
    import builtins

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                       "flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    info = common.machine_info()
    assert info["cpu_model"] == "Intel(R) Xeon(R) Processor" and info["vendor"] == "GenuineIntel"
    assert info["cpu_flags"] == ["amx_bf16", "avx2", "avx512_bf16", "avx512f"]
    assert info["cpu_count"] == os.cpu_count()
