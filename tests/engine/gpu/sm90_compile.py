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

from engine.gpu import triton_attention, triton_kv_write
from engine.gpu.triton_build import is_interpreted, jitted

SM90 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sm90(body, pointers: dict, constants: dict, num_warps: int = 4):
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
    return triton.compile(ASTSource(fn, signature, constants), target=SM90, options={"num_warps": num_warps})


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
    return usage


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
