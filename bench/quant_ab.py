"""SmolLM2-135M-Instruct with its GGUF weights kept quantized (``quantization: auto``: Q4_1 blocks, a Q8_0
embedding and tied LM head) against the same weights dequantized to float32 (``quantization: none``).

    python -m bench.quant_ab [--reps 5] [--quick]

One torch thread. 1. batch-1 decode step: both engines loaded in one process, runs of 24 steps alternated
   (``bench.common.interleave``), median and best step over all runs but the first of each;
2. prefill of one 400-token prompt, the same way;
3. memory per worker: each mode loaded in a fresh process (``memory_of``).
Writes ``quant_ab.json``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

from bench.common import interleave, median, parse_args, print_table, progress, timed, torch_threads, write_json
from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.model_registry import SMOLLM2_NAME
from engine.worker_model import WorkerModel

MODES = ("auto", "none")
PROMPT_LEN = 400


def memory_of(mode: str) -> dict:
    """Resident MiB of a fresh process that loads SmolLM2 with ``quantization: mode``: before the load
    (torch, transformers imported), after it, after glibc hands freed memory back (``malloc_trim``: the
    converted float32 folder read at load is freed but may stay in malloc's heap), and its peak."""
    code = f"""
import ctypes, json
from engine import EngineConfig
from engine.worker_model import WorkerModel
def rss(key='VmRSS'):
    return int(dict(l.split(':') for l in open('/proc/self/status'))[key].split()[0]) / 1024
before = rss()
m = WorkerModel.load(EngineConfig(model={SMOLLM2_NAME!r}, device='cpu', quantization={mode!r}))
loaded = rss()
ctypes.CDLL('libc.so.6').malloc_trim(0)
print(json.dumps(dict(rss_before_mib=before, rss_loaded_mib=loaded, rss_trimmed_mib=rss(), peak_mib=rss('VmHWM'))))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def make_engine(mode: str, num_tokens: int) -> LLMEngine:
    config = EngineConfig(model=SMOLLM2_NAME, device="cpu", quantization=mode, num_pages=max(64, num_tokens // 16 + 8),
                          max_num_batched_tokens=512, enable_prefix_caching=False)
    return LLMEngine(config, model=WorkerModel.load(config))


def steps_of(engine: LLMEngine, prompt: list[int], num_steps: int, count: list[int]) -> tuple[float, list[float]]:
    """(the prefill's seconds, each decode step's seconds) of one request."""
    count[0] += 1
    engine.add_request(f"r{count[0]}", prompt, SamplingParams(max_tokens=num_steps + 1, ignore_eos=True))
    prefill = timed(engine.step)[1]
    times = [timed(engine.step)[1] for _ in range(num_steps)]
    while engine.has_unfinished():
        engine.step()
    return prefill, times


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    steps, reps, threads = (4, 1, 1) if args.quick else (24, args.reps or 5, 1)
    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(PROMPT_LEN)]
    figures: dict = {"threads": threads, "steps": steps, "reps": reps, "prompt_len": PROMPT_LEN}
    with torch_threads(threads):
        engines = {mode: make_engine(mode, PROMPT_LEN + reps * (steps + 2)) for mode in MODES}
        count = [0]
        progress(f"{reps} x {steps} batch-1 decode steps and a {PROMPT_LEN}-token prefill, modes alternated")
        runs = interleave(reps + 1, {mode: (lambda e=e: steps_of(e, prompt, steps, count))
                                     for mode, e in engines.items()})
    rows = []
    for mode in MODES:
        decode = [t for prefill, times in runs[mode][1:] for t in times]
        prefill = [p for p, _ in runs[mode][1:]]
        figures[mode] = {"step_ms": median(decode) * 1e3, "step_ms_best": min(decode) * 1e3,
                         "prefill_ms": median(prefill) * 1e3, **memory_of(mode)}
        rows.append([mode, *(figures[mode][k] for k in ("step_ms", "step_ms_best", "prefill_ms", "rss_before_mib",
                                                        "rss_loaded_mib", "rss_trimmed_mib", "peak_mib"))])
    print_table("SmolLM2-135M-Instruct, quantized (auto) vs dequantized float32 (none), one torch thread",
                ["quantization", "step ms", "best ms", f"prefill {PROMPT_LEN} ms", "RSS before load MiB",
                 "loaded", "trimmed", "peak"], rows)
    write_json(args.out, "quant_ab", figures)
    return figures


if __name__ == "__main__":
    main()
