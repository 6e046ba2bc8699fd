"""``n = 4`` against four sequential single requests, output tokens per second, side by side (issue 47).

SmolLM2-135M-Instruct served aggregated (no drafts) by a real Ray Serve on 127.0.0.1, the same config
as tests/app/test_smollm2.py. Per rep, both candidates get a prompt of their own (a fresh nonce first:
neither finds the other's blocks cached) and ask for MAX_TOKENS tokens each (``ignore_eos``), sampled
with a seed:

    n4          one /v1/completions request with n=4, seed s   (the children decode as one batch)
    sequential  four single requests with seeds s..s+3, one after the other

    output tok/s = 4 * MAX_TOKENS / wall seconds of the candidate

The candidates alternate rep by rep (bench.common.interleave). Writes ``n_choices.json`` to ``--out``
(bench/results by default). Figures on a shared machine are under whatever load it carries: the JSON
records the load average at the start.

    python -m bench.n_choices [--quick] [--reps N]
"""

from __future__ import annotations

import socket
import time
import uuid

import httpx

from bench.common import interleave, median, parse_args, print_table, progress, ratio, start_ray, write_json
from engine.model_registry import SMOLLM2_NAME

ENGINE = {"model": SMOLLM2_NAME, "tokens_per_block": 16, "num_pages": 160, "max_num_seqs": 8,
          "max_num_batched_tokens": 512, "device": "cpu"}
MAX_TOKENS = 64
N = 4
SEED = 2026
PROMPT = "Here are some notes about kites. " + "The red kite flew over the harbour at nine o'clock. " * 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(http: httpx.Client, prompt: str, n: int, seed: int) -> int:
    """Output tokens of one request (from its usage)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "n": n, "seed": seed, "temperature": 0.8, "ignore_eos": True}
    reply = http.post("/v1/completions", json=body)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


def measure(http: httpx.Client, reps: int) -> dict[str, list[float]]:
    def n4() -> float:
        start = time.perf_counter()
        num_tokens = completion(http, f"{uuid.uuid4().hex} {PROMPT}", N, SEED)
        return num_tokens / (time.perf_counter() - start)

    def sequential() -> float:
        prompt, start = f"{uuid.uuid4().hex} {PROMPT}", time.perf_counter()
        num_tokens = sum(completion(http, prompt, 1, SEED + i) for i in range(N))
        return num_tokens / (time.perf_counter() - start)

    return interleave(reps, {"n4": n4, "sequential": sequential})


def main(argv: list[str] | None = None) -> None:
    from ray import serve

    from app import serve_app
    from engine.model_registry import resolve_model_path

    args = parse_args(__doc__.splitlines()[0], argv)
    reps = args.reps or (1 if args.quick else 5)
    out = "bench/results" if args.out == "bench/out" else args.out
    resolve_model_path(ENGINE["model"])
    start_ray(address="local", num_cpus=2)
    try:
        port = free_port()
        serve_app.start_serve(port)
        serve.run(serve_app.build_app({**ENGINE, "mode": "aggregated", "transport": "local"}), name="agg",
                  route_prefix="/agg")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/agg", timeout=300) as http:
            progress("warming up")
            completion(http, PROMPT, N, SEED)
            progress(f"{reps} reps of each candidate")
            runs = measure(http, reps)
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
    figures = {name: median(values) for name, values in runs.items()}
    speedup = ratio(figures["n4"], figures["sequential"])
    print_table(f"output tok/s, median of {reps} (n={N}, {MAX_TOKENS} tokens each)",
                ["candidate", "tok/s", "runs"], [[name, figures[name], runs[name]] for name in runs])
    print(f"\nn4 / sequential = {speedup:.2f}")
    path = write_json(out, "n_choices", {"engine": ENGINE, "n": N, "max_tokens": MAX_TOKENS, "reps": reps,
                                         "tok_s": runs, "median_tok_s": figures, "speedup": speedup})
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
