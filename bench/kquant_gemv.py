"""The few-row kernel (quant_linear) at batch 1 on Gemma 3 270M's matmul shapes, each GGUF kind its
Q4_K_M file uses (and Q5_K), against the same weights dequantized to float32 through torch's matmul.

    python -m bench.kquant_gemv [--reps 200] [--threads 1] [--quick]

Shapes ([out, in]): q [1024, 640], gate / up [2048, 640], down [640, 2048], o [640, 1024], and the LM
head (the tied Q8_0 embedding) [262144, 640]. Blocks are random bytes with scales giving weights of ~0.05
(the kernels' time does not depend on the values). Each cell: the kernel and torch's float32 matmul
alternated (``bench.common.interleave``), the median call over all reps but the first. Writes
``kquant_gemv.json``.

The layer shapes' weights stay in cache from call to call (2.6-5.2 MB float32, 0.4-1.1 MB quantized): there
the float32 matmul reads cache, not memory, and the quantized kernels' unpacking is what costs. The LM head
(178 MB of Q8_0, 671 MB float32) is read from memory by both: what a decode step sees for every weight.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.common import interleave, median, print_table, progress, timed, torch_threads, write_json
from engine.models.quantized import BLOCK_BYTES, BLOCK_WEIGHTS, KIND_NAMES, QuantizedWeight
from engine.native import quant_linear_kernel

SHAPES = {"q": (1024, 640), "gate/up": (2048, 640), "down": (640, 2048), "o": (640, 1024)}
KINDS = (6, 8, 12, 13, 14)  # Q5_0, Q8_0, Q4_K, Q5_K, Q6_K
LM_HEAD = (262144, 640)
# each block's first f16 (the scale multiplying q), and where a K-quant or Q4_1 has one, the offset's
SCALE_FIELDS = {6: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_weight(kind: int, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind]),
                          dtype=np.uint8)
    per_block = blocks.reshape(out_features, -1, BLOCK_BYTES[kind])
    for offset in SCALE_FIELDS[kind]:  # finite scales: NaN or Inf would not change the time, but look wrong
        per_block[..., offset:offset + 2] = np.float16(1e-3).reshape(1).view(np.uint8)
    return QuantizedWeight(torch.from_numpy(blocks), kind)


def time_pair(weight: QuantizedWeight, reps: int) -> dict:
    """Median seconds of quant_linear and of torch.matmul on the dequantized weight, for one float32 row."""
    linear = quant_linear_kernel()
    dense = weight.dequantize()
    x = torch.randn(1, weight.shape[1])
    runs = interleave(reps + 1, {"quant": lambda: timed(linear, x, weight.blocks, weight.kind, None)[1],
                                 "float32": lambda: timed(torch.matmul, x, dense.T)[1]})
    quant, fp32 = median(runs["quant"][1:]), median(runs["float32"][1:])
    return {"quant_us": quant * 1e6, "float32_us": fp32 * 1e6, "speedup": fp32 / quant,
            "quant_gb_s": weight.nbytes / quant / 1e9, "float32_gb_s": dense.numel() * 4 / fp32 / 1e9}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few reps, no LM head (smoke test)")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 200)
    figures: dict = {"threads": args.threads, "reps": reps, "cells": []}
    rows = []
    with torch_threads(args.threads):
        cells = [(kind, name, shape) for name, shape in SHAPES.items() for kind in KINDS]
        if not args.quick:
            cells.append((8, "lm_head", LM_HEAD))
        for kind, name, shape in cells:
            progress(f"{KIND_NAMES[kind]} {name} {shape}")
            cell = {"kind": KIND_NAMES[kind], "matmul": name, "shape": list(shape),
                    **time_pair(random_weight(kind, *shape), reps if name != "lm_head" else max(3, reps // 20))}
            figures["cells"].append(cell)
            rows.append([name, f"{shape[0]}x{shape[1]}", cell["kind"], cell["quant_us"], cell["float32_us"],
                         cell["speedup"], cell["quant_gb_s"], cell["float32_gb_s"]])
    print_table(f"batch-1 GEMV, {args.threads} torch thread(s): quant_linear vs torch.matmul on float32",
                ["matmul", "out x in", "kind", "quant us", "float32 us", "speedup", "quant GB/s", "float32 GB/s"],
                rows)
    write_json(args.out, "kquant_gemv", figures)
    return figures


if __name__ == "__main__":
    main()
