"""Compile engine.gpu's Triton kernels for sm_90 (H100/H200) on a machine without a GPU, with the
wheel's LLVM and ptxas, and print each cubin's resource usage as JSON (``cuobjdump``'s REG/STACK).

Run in a process of its own (tests/engine/gpu/test_triton_compile.py does): Triton compiles only
where it was imported without TRITON_INTERPRET.  ``python -m tests.engine.gpu.sm90_compile``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.gpu import triton_attention, triton_kv_write, triton_sampling
from engine.gpu.triton_build import is_interpreted, jitted

SM90 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sm90(body, pointers: dict, constants: dict, num_warps: int = 4, **options):
    """Every ``*_ptr`` argument typed by ``pointers`` (default int32), ``scale`` float32, the rest int64."""
    fn = jitted(body)
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "i32")
        else:
            signature[name] = "fp32" if name == "scale" else "i64"
    return triton.compile(ASTSource(fn, signature, constants), target=SM90, options={"num_warps": num_warps, **options})


def resource_usage(kernel) -> dict:
    """``{"REG": 88, "STACK": 0, "mma": True}``: registers, spill stack bytes, tensor-core instructions."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(line for line in dump.splitlines() if "REG:" in line)
    fields = dict(field.split(":") for field in line.split() if field.startswith(("REG:", "STACK:")))
    return {name: int(value) for name, value in fields.items()} | {"mma": "mma" in kernel.asm["ptx"]}


def decode_usage(dtype: str, group: int, head_dim: int, is_split: bool) -> dict:
    constants, num_warps = triton_attention.decode_constants(group, head_dim, 16, has_window=True, has_sinks=True,
                                                             is_split=is_split, dot_fp32=dtype == "fp32")
    pointers = dict(query_ptr=dtype, cache_ptr=dtype, positions_ptr="i64", sinks_ptr="fp32",
                    out_ptr="fp32" if is_split else dtype, lse_ptr="fp32")
    return resource_usage(compile_sm90(triton_attention._decode_body, pointers, constants, num_warps))


def sampling_usage(dtype: str, has_cut: bool, num_splits: int) -> dict:
    """resource_usage plus what the PTX does in float32: ``div_rn`` (IEEE divisions), ``div_approx`` (``/``'s
    div.full or div.approx), ``fma`` (fused multiply-adds), ``approx_log`` (lg2.approx): the one-pass
    sampler is bit-exact against torch only with IEEE divisions and nothing fused or approximated."""
    pointers = dict(logits_ptr=dtype, temperature_ptr="fp32", cut_value_ptr="fp32", out_ptr="i64",
                    part_max_ptr="fp32")
    constants = dict(HAS_CUT=has_cut, NUM_SPLITS=num_splits, BLOCK=triton_sampling.BLOCK)
    kernel = compile_sm90(triton_sampling._sample_body, pointers, constants, enable_fp_fusion=False)
    ptx = kernel.asm["ptx"]
    return resource_usage(kernel) | {"div_rn": ptx.count("div.rn.f32"), "fma": ptx.count("fma."),
                                     "div_approx": ptx.count("div.full") + ptx.count("div.approx"),
                                     "approx_log": ptx.count("lg2.approx")}


def main() -> dict:
    assert not is_interpreted(), "run without TRITON_INTERPRET"
    usage = {f"decode {dtype} G={g} D={d}{' split' if split else ''}": decode_usage(dtype, g, d, split)
             for dtype, g, d, split in [("bf16", 8, 128, False), ("bf16", 4, 64, False), ("fp32", 4, 64, True)]}
    usage["combine"] = resource_usage(compile_sm90(
        triton_attention._combine_body, dict(parts_ptr="fp32", lse_ptr="fp32", sinks_ptr="fp32", out_ptr="bf16"),
        dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=8, HAS_SINKS=True)))
    usage["write_kv"] = resource_usage(compile_sm90(
        triton_kv_write._write_body, dict(cache_ptr="bf16", slot_mapping_ptr="i64", key_ptr="bf16",
                                          value_ptr="bf16"), dict(BLOCK_SIZE=16, WIDTH=8 * 128, BLOCK_W=1024)))
    usage["sample bf16"] = sampling_usage("bf16", has_cut=False, num_splits=1)
    usage["sample fp32 cut split"] = sampling_usage("fp32", has_cut=True, num_splits=4)
    return usage


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
