"""Our engine against transformers ``generate`` on one CUDA GPU, in float32 and bf16.

    python -m bench.engine_cuda [--quick] [--out bench/out] [--reps N] [--models a,b] [--device cuda]
                                [--no-shapes]

``bench.engine``'s throughput figure on the GPU: output tokens/s of ``engine.LLM``
over transformers ``generate`` (left-padded batches of c, its default attention)
on the same model folder, seeded prompts and greedy ``max_tokens``, ours with
``max_num_seqs = c``; the two alternate rep by rep. float32 runs with TF32 off on
both sides, so outputs must be equal; in bf16 the count of equal outputs is
reported (two bf16 implementations round in different places). ``--device cpu``
is a dry run (tests/bench): smallest sizes, nothing about it is a figure.

Then, in bf16 on the random models of real shapes (bench.gpu_workload; ``--no-shapes`` skips it):
nano-vllm's workload (output tokens/s) and the decode step time at batch 1 and 64. ``--quick`` and
the dry run shrink those models and the workload.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from functools import partial

import torch

from bench.common import interleave, parse_args, print_table, progress, write_json
from bench.engine import run_fresh, run_hf, throughput_row
from bench.engine_models import REAL_MODELS, available_models, parse_models, prompts_for
from bench.gpu_workload import SHAPES, TINY, WORKLOADS, build_shape_model, decode_step_ms, run_nano_vllm_workload
from engine.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = {
    "full": dict(num_prompts=64, lengths=(16, 256), max_tokens=32, concurrencies=(1, 8, 32, 64), reps=2,
                 models=("windserve-tiny", "gptoss-mid", "smollm2-shape"), tiny_shapes=False,
                 workload=WORKLOADS["full"], decode_batches=(1, 64), decode_prompt_len=512, decode_steps=20),
    "quick": dict(num_prompts=8, lengths=(8, 64), max_tokens=8, concurrencies=(1, 8), reps=1,
                  models=("windserve-tiny",), tiny_shapes=True, workload=WORKLOADS["tiny"], decode_batches=(1, 2),
                  decode_prompt_len=16, decode_steps=4),
}


def measure(model: str, path: str, dtype: str, device: str, mode: dict, reps: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype]).to(device).eval()
    tokenizer = Tokenizer(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts, max_tokens = prompts_for(model, path, mode), mode["max_tokens"]
    longest, rows = max(map(len, prompts)), []
    for c in mode["concurrencies"]:
        chosen = prompts[:max(8, min(len(prompts), 2 * c))]  # c = 1 runs one at a time: fewer prompts
        run_hf(hf, chosen[:2], 2, c, pad_id)  # warm-up, not timed
        progress(f"{model} {dtype} c={c}: {reps} x (ours, transformers) on {len(chosen)} prompts, {max_tokens} tokens")
        # both end in host token lists, so each timing covers the GPU work it queued
        runs = interleave(reps, {"ours": partial(run_fresh, path, c, longest, chosen, max_tokens, device=device,
                                                 dtype=dtype),
                                 "hf": partial(run_hf, hf, chosen, max_tokens, c, pad_id)})
        row = {**throughput_row(model, c, runs, len(chosen) * max_tokens), "dtype": dtype}
        rows.append(row)
        progress(f"  ours {row['ours_tok_s']:.0f} tok/s, transformers {row['hf_tok_s']:.0f} tok/s, "
                 f"ratio {row['ratio']:.2f}, equal outputs {row['outputs_equal']}")
    del hf
    return rows


def shape_figures(device: str, mode: dict, tmp: str) -> list[dict]:
    """nano-vllm's workload and decode step times, bf16, on each of bench.gpu_workload's shapes."""
    rows = []
    for name, (_, _, shape) in SHAPES.items():
        path = build_shape_model(name, f"{tmp}/{name}", tiny=mode["tiny_shapes"])
        vocab = (TINY if mode["tiny_shapes"] else shape)["vocab_size"]
        progress(f"{name}: nano-vllm's workload ({mode['workload']['num_seqs']} sequences), bf16")
        row = {"model": name, **run_nano_vllm_workload(path, vocab, device, "bfloat16", mode["workload"])}
        for batch in mode["decode_batches"]:
            step = decode_step_ms(path, batch, mode["decode_prompt_len"], device, "bfloat16", mode["decode_steps"])
            row[f"decode_step_ms_batch_{batch}"] = step["step_ms"]
            row[f"gpu_busy_batch_{batch}"] = step["gpu_busy"]
        progress(f"  {row['output_tok_s']:.0f} output tok/s; decode steps (ms) "
                 + ", ".join(f"{k}: {v:.2f}" for k, v in row.items() if k.startswith("decode_step"))
                 + "; GPU busy " + ", ".join(f"{k}: {v:.0%}" for k, v in row.items()
                                             if k.startswith("gpu_busy") and v is not None))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    shapes_parser = argparse.ArgumentParser(add_help=False)
    shapes_parser.add_argument("--no-shapes", action="store_true", help="skip the real shapes' figures")
    known, argv = shapes_parser.parse_known_args(argv)
    models, argv = parse_models(argv)
    args = parse_args(__doc__.splitlines()[0], argv, device=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")
    mode = MODES["quick" if args.quick or args.device == "cpu" else "full"]
    reps = args.reps or mode["reps"]
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    tmp = tempfile.mkdtemp(prefix="windserve-bench-")
    try:
        chosen = models or mode["models"]  # parse_models refused any name outside MODEL_CHOICES
        paths = available_models(chosen, tmp)
        rows = [row for model, path in paths.items() for dtype in DTYPES
                for row in measure(model, path, dtype, args.device, mode, reps)]
        shape_rows = [] if known.no_shapes else shape_figures(args.device, mode, tmp)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        shutil.rmtree(tmp, ignore_errors=True)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    figures = {"mode": "quick" if mode is MODES["quick"] else "full", "device": device_name, "reps": reps,
               "settings": {**mode, "models": list(paths)}, "throughput": rows, "shapes": shape_rows,
               "real_models_skipped_without_package": [m for m in chosen if m in REAL_MODELS and m not in paths]}
    progress(f"wrote {write_json(args.out, 'engine_cuda', figures)}")
    print_table(f"throughput on {device_name} (output tokens/s, greedy; ratio = ours / transformers)",
                ["model", "dtype", "conc", "ours", "transformers", "ratio", "equal outputs"],
                [[r["model"], r["dtype"], r["concurrency"], r["ours_tok_s"], r["hf_tok_s"], r["ratio"],
                  r["outputs_equal"]] for r in rows])
    if shape_rows:
        batches = mode["decode_batches"]
        print_table(f"random models of real shapes on {device_name}, bf16: nano-vllm's workload and decode steps",
                    ["model", "output tok/s", *[f"step ms, batch {b}" for b in batches],
                     *[f"GPU busy, batch {b}" for b in batches]],
                    [[r["model"], r["output_tok_s"], *[r[f"decode_step_ms_batch_{b}"] for b in batches],
                      *["-" if r[f"gpu_busy_batch_{b}"] is None else f"{r[f'gpu_busy_batch_{b}']:.0%}"
                        for b in batches]]
                     for r in shape_rows])
    return figures


if __name__ == "__main__":
    main()
