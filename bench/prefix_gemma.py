"""Gemma 3 270M: time to first token of a ~2,000-token prompt cold (empty prefix cache) and warm (its first
1,904 tokens cached by an earlier prompt), alternated rep by rep in one process, one engine each.

    python -m bench.prefix_gemma [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.worker_model import WorkerModel

MODEL = "gemma3-270m"
SHARED = 1904


def text(num_items: int) -> str:
    return " ".join(f"Box {i} holds {(i * 7) % 13} apples and {(i * 5) % 11} pears." for i in range(num_items))


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add to the first token, and the prompt's cached tokens."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:
        for update in engine.step():
            if update.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, update.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model = WorkerModel.load(EngineConfig(model=MODEL, device="cpu"))
    base = model.tokenizer.encode_prompt(text(200))[:SHARED + 64]
    config = dict(model=MODEL, device="cpu", tokens_per_block=16, num_pages=512, max_num_batched_tokens=512)
    cold, warm = [], []
    for rep in range(args.reps):
        tail = model.tokenizer.encode(f" Rep {rep}: box {rep} holds a lemon.")
        prompt = base[:SHARED] + tail
        for is_warm in (rep % 2 == 0, rep % 2 == 1):  # the order flips every rep
            engine = LLMEngine(EngineConfig(**config), model=model)
            if is_warm:
                ttft(engine, "first", base)
            seconds, cached = ttft(engine, "second", prompt)
            (warm if is_warm else cold).append(seconds)
            print(f"rep {rep} {'warm' if is_warm else 'cold'}: {seconds * 1000:.0f} ms, {cached} cached of "
                  f"{len(prompt)}", flush=True)
    print(f"cold/warm TTFT median {statistics.median(cold) / statistics.median(warm):.2f}x "
          f"(cold {statistics.median(cold) * 1000:.0f} ms, warm {statistics.median(warm) * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
