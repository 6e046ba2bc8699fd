"""What every benchmark shares: arguments, progress lines, timing, JSON + PNG output, a table.

Figures are ratios of A and B measured side by side in one run: ``interleave``
alternates the candidates rep by rep (and flips their order every rep), so a
noisy neighbour on a shared machine slows both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import torch

_START = time.monotonic()


def parse_args(description: str, argv: list[str] | None = None, device: bool = False) -> argparse.Namespace:
    """The arguments every benchmark takes; ``device=True`` adds ``--device cpu|cuda`` for those that run on either."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smallest sizes and one repetition (smoke test)")
    parser.add_argument("--out", default=os.path.join("bench", "out"), help="folder for <name>.json and <name>.png")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each measurement (default: per mode)")
    if device:
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where pages and models live")
    return parser.parse_args(argv)


def synchronized(device: str) -> Callable[[], None]:
    """What a timer calls before reading the clock: waits for the GPU's queued work on CUDA, nothing on the CPU."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op threads while a benchmark runs, restored after: the setting is process-wide,
    and a benchmark's ``main()`` may be called from a test or a notebook."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def progress(message: str) -> None:
    """One line, prefixed by the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", flush=True)


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """``(fn(...), wall seconds)``."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def timed_cpu(fn: Callable, *args, **kwargs) -> tuple[object, float, float]:
    """``(fn(...), wall seconds, CPU seconds of this process)``.

    On a shared machine the wall time includes waiting for a core; the CPU
    time does not, so for single-threaded in-process work it is the steadier
    figure (it still includes slowdowns from shared caches and memory).
    """
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def interleave(reps: int, candidates: dict[str, Callable[[], object]]) -> dict[str, list]:
    """Run every candidate ``reps`` times, alternating them and reversing their order every other rep.

    Returns each candidate's results (whatever its callable returns), in rep order.
    """
    names = list(candidates)
    results: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            results[name].append(candidates[name]())
    return results


async def ainterleave(reps: int, candidates: dict[str, Callable[[], Awaitable]]) -> dict[str, list]:
    """``interleave`` for coroutine functions: each run is awaited before the next starts."""
    names = list(candidates)
    results: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            results[name].append(await candidates[name]())
    return results


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    return float("nan") if denominator == 0 else numerator / denominator


def cpu_model() -> dict:
    """The CPU's model name and the flags that decide our kernels (benches ran on AMD and on Intel boxes)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    field = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in lines if ":" in line}
    flags = set(field.get("flags", "").split())
    return {"cpu_model": field.get("model name"), "vendor": field.get("vendor_id"),
            "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})}


def machine_info() -> dict:
    return {
        **cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def write_json(out_dir: str, name: str, figures: dict) -> str:
    """``<out_dir>/<name>.json``: the figures plus the command, the date and the machine."""
    os.makedirs(out_dir, exist_ok=True)
    record = {
        "name": name,
        "command": " ".join(["python", *sys.orig_argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - _START, 1),
        "machine": machine_info(),
        **figures,
    }
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=False, default=float)
        f.write("\n")
    return path


def write_plot(out_dir: str, name: str, draw: Callable) -> str | None:
    """``draw(plt)`` fills a figure saved as ``<out_dir>/<name>.png``; None (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return None
    os.makedirs(out_dir, exist_ok=True)
    draw(plt)
    path = os.path.join(out_dir, f"{name}.png")
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close("all")
    return path


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _cell(value) -> str:
    if not isinstance(value, float):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3g}"


def start_ray(attempts: int = 3, **init_kwargs) -> None:
    """``ray.init(**init_kwargs)`` without the dashboard or driver logs; benchmarks and tests start Ray here.

    Ray waits a fixed 30 s for its raylet to register; on a loaded machine that
    can lapse although nothing is wrong, so that one failure is retried. A
    failed start is shut down, unless Ray was already running in this process
    before the call (then ``ray.init`` refuses, and the running Ray is left alone).
    Pass ``address="local"`` for a new instance, never a cluster someone else started.
    """
    import ray

    init_kwargs = {"include_dashboard": False, "log_to_driver": False, **init_kwargs}
    was_running = ray.is_initialized()
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception on a start-up timeout
            if not was_running:
                ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            progress(f"Ray start-up timed out (attempt {attempt} of {attempts}); retrying")
            time.sleep(2)


def build_gptoss_model(directory: str, **overrides) -> str:
    """A random GPT-OSS-shaped model in ``directory`` (GptOssConfig + save_pretrained, seed 0),
    with windserve-tiny's byte-level tokenizer; ``overrides`` are config fields
    (``layer_types`` alternate window / full over ``num_hidden_layers``)."""
    import shutil

    from transformers import GptOssConfig, GptOssForCausalLM

    from engine.tiny import ensure_tiny_model, tiny_config_dict

    cfg = {k: v for k, v in tiny_config_dict().items() if k not in ("architectures", "model_type", "dtype")}
    cfg.update(overrides)
    num_layers = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's random state stays as it was
        torch.manual_seed(0)
        GptOssForCausalLM(GptOssConfig(**cfg)).save_pretrained(directory)
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny, name), directory)
    return directory
