"""The device sampler's time per sampled step: the one-pass Triton kernel against the torch sampler it
replaced, at a real vocabulary's shapes (issue 49, item 3).

    python -m bench.sampling_gpu [--shapes 256x151936 64x49152] [--repeats 20] [--out bench/out]
    python -m bench.sampling_gpu --device cpu --shapes 3x1500 --repeats 1   # a dry run (tests, interpreted)

Per shape, float32 logits, every row sampled at temperature 0.8 (unfiltered; ``--top-p`` for a filtered
step), median milliseconds over ``--repeats`` after a warm-up, on CUDA events (CPU: wall time):

    previous   the sampler before the kernel: uniform_noise's int64 hash over [N, V], softmax, p / E, argmax
    torch      engine.gpu.sampling's torch ops (the Gumbel form, log_f32): where Triton is missing
    kernel     engine.gpu.triton_sampling's one pass (top-p: the sort for the cut first, in torch)
    greedy     logits.argmax: the floor (one read of the logits)

and whether the kernel's ids equal the torch ops' (they must, row for row). On a CPU without
TRITON_INTERPRET=1 the kernel column is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from engine.gpu.sampling import SamplingRows, sample_tokens, sampling_rows, uniform_noise


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["256x151936", "64x49152"], help="ROWSxVOCAB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def previous_sample_tokens(logits: torch.Tensor, rows: SamplingRows, is_filtered: bool) -> torch.Tensor:
    """engine.gpu.sampling.sample_tokens before the kernel (commit 51bf7fa), kept here to be timed: the
    exponential race ``argmax p / E``, E = -log u, over [N, V] tensors op by op."""
    greedy_ids = logits.argmax(dim=-1)
    is_sampled = rows.temperature > 0
    scaled = logits.float() / torch.where(is_sampled, rows.temperature, 1.0)[:, None]
    probs = _previous_filtered_probs(scaled, rows.top_k, rows.top_p) if is_filtered else scaled.softmax(dim=-1)
    noise = -torch.log(uniform_noise(rows.seed_lo, rows.seed_hi, rows.counters, logits.shape[-1]))
    return torch.where(is_sampled, (probs / noise).argmax(dim=-1), greedy_ids)


def _previous_filtered_probs(scaled, top_k, top_p):
    vocab_size = scaled.shape[-1]
    top_k = torch.where(top_k > 0, top_k, vocab_size).long()
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(scaled).scatter_(-1, sorted_ids, sorted_probs)


def median_ms(fn, repeats: int, device: str) -> float:
    fn()  # warm-up (and the kernel's compile)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def kernel_runs(device: str) -> bool:
    """CUDA, or a CPU process whose Triton interprets (imported only if asked: the import fixes its mode)."""
    if device == "cuda":
        return True
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    from engine.gpu.triton_build import is_interpreted

    return is_interpreted()


def measure(num_rows: int, vocab: int, args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(num_rows * vocab)
    logits = (torch.randn(num_rows, vocab, generator=generator) * 3).to(args.device)
    rows = sampling_rows([0.8] * num_rows, [0] * num_rows, [args.top_p] * num_rows,
                         [1234 + i for i in range(num_rows)], [17 * i for i in range(num_rows)], logits.device)
    is_filtered = args.top_p < 1.0
    steps = {"previous": lambda: previous_sample_tokens(logits, rows, is_filtered),
             "torch": lambda: sample_tokens(logits, rows, is_greedy=False, is_filtered=is_filtered, use_kernel=False),
             "greedy": lambda: logits.argmax(dim=-1)}
    has_kernel = kernel_runs(args.device)
    if has_kernel:
        steps["kernel"] = lambda: sample_tokens(logits, rows, is_greedy=False, is_filtered=is_filtered,
                                                use_kernel=True)
    row = {"rows": num_rows, "vocab": vocab, "top_p": args.top_p, "device": args.device}
    row.update({f"{name}_ms": round(median_ms(fn, args.repeats, args.device), 4) for name, fn in steps.items()})
    if has_kernel:
        same = steps["kernel"]().cpu() == steps["torch"]().cpu()
        row["ids_equal"] = f"{int(same.sum())}/{num_rows}"
        row["speedup"] = round(row["previous_ms"] / row["kernel_ms"], 2)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    results = []
    for shape in args.shapes:
        num_rows, vocab = (int(part) for part in shape.split("x"))
        row = measure(num_rows, vocab, args)
        results.append(row)
        print("sampling " + " ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = f"sampling_gpu_{args.device}" + ("" if args.top_p == 1.0 else f"_top_p_{args.top_p}")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = [r for r in results if "ids_equal" in r and r["ids_equal"] != f"{r['rows']}/{r['rows']}"]
    if bad:
        raise SystemExit(f"the kernel's ids differ from the torch ops': {bad}")
    return results


if __name__ == "__main__":
    main()
