"""Native CPU kernels (this folder's C++), built on first use by torch's extension builder (the
system's C++ compiler and ninja, once per machine, checkout and source, then loaded from torch's
extension cache, ``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``). Only bindings.cpp and
decode_stack.cpp include ``torch/extension.h`` (pybind11 and torch's whole C++ API); the kernels parse
ATen alone, which compiles each about 3x faster (86 s against 25 s for rmsnorm.cpp at -O3 on the
2-core box, 2026-12-07) and made the objects ~5x smaller.

- ``paged_decode``: attention of a few new queries per request read in place from the KV pages
  (``engine.attention_plan``'s in-place requests), and ``write_kv``: a step's new K/V into their pages;
- ``moe_route``: GPT-OSS's routing (top-k, softmax, pairs sorted by expert), ``clamped_swiglu``:
  its expert activation in one pass, ``add_weighted_rows``: its combine step, and ``moe_experts``:
  the whole expert layer of a decode step's few tokens in one call (``engine.models.gpt_oss``);
- ``rotate_half``: the rotary embedding of q and k in one pass, and ``rms_norm`` (``engine.models.layers``);
- ``rows_linear``: the matmul of a few rows (a decode step's), each weight row read once as one
  memory stream (``engine.models.packed``);
- ``quant_linear``, ``quant_matmul``, ``quant_rows``: matmuls on GGUF weights kept in their Q8_0 / Q4_0 /
  Q4_1 / Q5_0 blocks or Q4_K / Q5_K / Q6_K super-blocks, and their rows dequantized
  (``engine.models.quantized``);
- ``DecodeStack``: every layer of a Llama-family decoder for a few-row step, one call from Python
  (``engine.models.native_stack``).

Where the build fails (no compiler) or ``WINDSERVE_NATIVE=0``, the accessors return None and the
callers keep their torch path.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
# -fopenmp: at::parallel_for is inline code that forks only where the extension is built with OpenMP
# (torch's CPU wheels run their intra-op pool on OpenMP); without it every kernel ran on one thread
# whatever torch.set_num_threads said. The extension links libgomp.so.1, the soname torch's own copy has,
# so the loader reuses torch's runtime and its thread count.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]


def _build_tag() -> str:
    """The sources (headers included: torch's builder versions the listed sources only), the CPU (the
    build uses ``-march=native``, so a cache shared by two kinds of CPU must not mix their builds) and
    the checkout's path: torch's build folder records its sources' paths, so two checkouts of the same
    sources sharing one folder rebuilt it in turn, each under the other's lock (seen on 2026-12-04); and
    the ``ninja`` on PATH: ninja 1.12 changed the command hash in its build log, so a shell with the
    venv's ninja (1.13) and one with the system's (1.11) rebuilt one folder in turn (seen on 2026-12-05)."""
    digest = hashlib.sha1(platform.machine().encode())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(_HERE.encode())
    digest.update(_ninja_version().encode())
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            digest.update(next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "").encode())
    except OSError:
        pass
    for path in sorted(glob.glob(os.path.join(_HERE, "*.cpp")) + glob.glob(os.path.join(_HERE, "*.h"))):
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()[:12]


def _ninja_version() -> str:
    ninja = shutil.which("ninja")
    if ninja is None:
        return ""
    try:
        return ninja + subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ninja


STALE_LOCK_S = 60.0


def clear_stale_lock(build_directory: str, min_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build folder's ``lock`` if a killed build left it: older than ``min_age_s`` while no
    process works in the folder (torch runs ninja there for the whole compile). torch's builder waits on
    that lock for ever, so one ``serve run`` stopped during its first build hung every later start
    (seen on 2026-12-05). True when a lock was removed."""
    lock = os.path.join(build_directory, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except OSError:
        return False
    if age < min_age_s or _someone_works_in(build_directory):
        return False
    logger.warning("removing %s, %.0f s old with no build running in its folder (a killed build's)", lock, age)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return True


def _someone_works_in(folder: str) -> bool:
    """Whether a live process has ``folder`` as its working directory (Linux's /proc; elsewhere: assume so)."""
    if not os.path.isdir("/proc"):
        return True
    real = os.path.realpath(folder)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/cwd") == real:
                return True
    return False


@functools.cache
def _module():
    if os.environ.get("WINDSERVE_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"windserve_native_{_build_tag()}"
        clear_stale_lock(_get_build_directory(name, verbose=False))
        return load(name=name,
                    sources=sorted(glob.glob(os.path.join(_HERE, "*.cpp"))),
                    extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure means: keep the torch paths
        logger.warning("native CPU kernels unavailable, the torch paths run instead: %s", error)
        return None


def _kernel(name: str):
    module = _module()
    return None if module is None else getattr(module, name)


def paged_decode_kernel():
    """``paged_decode(query, cache, layer, first_rows, query_lens, seq_lens, tables, window, scale, sinks, out)``
    (paged_decode.cpp), or None."""
    return _kernel("paged_decode")


def clamped_swiglu_kernel():
    """``clamped_swiglu(gate_up, alpha, limit) -> out`` (swiglu.cpp), or None."""
    return _kernel("clamped_swiglu")


def add_weighted_rows_kernel():
    """``add_weighted_rows(out, tokens, rows, weights)`` (combine.cpp), or None."""
    return _kernel("add_weighted_rows")


def rotate_half_kernel():
    """``rotate_half(x, cos, sin) -> out`` (rope.cpp), or None."""
    return _kernel("rotate_half")


def moe_route_kernel():
    """``moe_route(logits, k) -> [tokens, weights, counts]`` (route.cpp), or None."""
    return _kernel("moe_route")


def rows_linear_kernel():
    """``rows_linear(x, weight, bias) -> x @ weight.T + bias`` for a few rows (gemv.cpp), or None."""
    return _kernel("rows_linear")


def moe_experts_kernel():
    """``moe_experts(x, tokens, weights, counts, gate_up, gate_up_bias, down, down_bias, alpha, limit) -> out``
    (moe.cpp), or None."""
    return _kernel("moe_experts")


def rms_norm_kernel():
    """``rms_norm(x, weight, eps) -> out`` (rmsnorm.cpp), or None."""
    return _kernel("rms_norm")


def argmax_rows_kernel():
    """``argmax_rows(logits) -> int64 ids``: torch.argmax(dim=-1) of contiguous float32 CPU rows, NaN first
    (argmax.cpp), or None."""
    return _kernel("argmax_rows")


def write_kv_kernel():
    """``write_kv(cache, layer, write_rows, key, value)`` (kv_write.cpp), or None."""
    return _kernel("write_kv")


def decode_stack_class():
    """``DecodeStack`` (decode_stack.cpp): a Llama-family decoder's layers for a few-row step in one call
    (engine.models.native_stack), or None."""
    return _kernel("DecodeStack")


def quant_linear_kernel():
    """``quant_linear(x, blocks, kind, bias) -> x @ W.T + bias`` for a few rows, W in GGUF blocks
    (quant_gemv.cpp), or None."""
    return _kernel("quant_linear")


def quant_matmul_kernel():
    """``quant_matmul(x, blocks, kind, bias, tile_rows, bf16) -> x @ W.T + bias``, W dequantized a tile of rows
    at a time and multiplied in float32, or in bfloat16 with ``bf16`` (quant.cpp), or None."""
    return _kernel("quant_matmul")


def set_pool_yields_kernel():
    """``set_pool_yields(yields)``: whether the few-row kernels' helper threads yield their core between
    jobs, for the step about to run (work_pool.cpp: decode-only steps yes, prefill and mixed steps no),
    or None."""
    return _kernel("set_pool_yields")


def quant_rows_kernel():
    """``quant_rows(blocks, kind, index) -> float32 rows`` of a GGUF-quantized weight (quant.cpp), or None."""
    return _kernel("quant_rows")
