"""The defect windserve exists to prevent, shown on real weights: Gemma 3 270M, disaggregated, 3 drafts.

The same greedy requests run three ways on one machine, in one process (engine level, pages copied as a
transport copies them):

    aggregated   one engine prefills and decodes                                  (the reference)
    ordinal      context engine -> the slice [stale_end, T) paired by ordinal -> generation engine
    count-based  the same, but the transfer keeps "the last n bound entries" of the generation table

The count-based selection is the defect reproduced as a test double (``count_based_plan``; it lives here
and in tests only, never in the library): the generation table is sized with the drafts (P + D + E,
``get_kv_capacity_tokens``), the transfer re-derives n from P + E. When P + D crosses a block boundary the
table has one more bound block than the slice, every pair lands one block late, and every count still
agrees. Reported: how many (request, group) slices carried that surplus block, how many generations
diverged from the aggregated tokens, and how many fell into a repetition loop.

    python -m bench.defect_slice [--num-prompts 24] [--max-tokens 48] [--out bench/results/defect_slice.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.handoff import kv_token_ids
from engine.worker_model import WorkerModel
from kvcache import plan_slice

MODEL = "gemma3-270m"
DRAFT_LEN = 3
B = 16
NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Grete"]
PLACES = ["market", "harbour", "library", "bakery", "station", "garden", "mill"]
ITEMS = ["apples", "candles", "nails", "loaves", "maps", "jars", "ropes"]


def count_based_plan(src: list[int], dst: list[int], num_kv_tokens: int, window: int | None, block: int):
    """The defect: the slice's source blocks paired with the last n bound destination entries."""
    first = 0 if window is None else max(0, (num_kv_tokens + 1 - window) // block)
    n = math.ceil(num_kv_tokens / block) - first
    dst_bound = [page for page in dst if page >= 0]
    return [(first + k, s, d) for k, (s, d) in enumerate(zip(src[first:first + n], dst_bound[len(dst_bound) - n:]))]


def diary(num_days: int) -> str:
    return " ".join(f"On day {d}, {NAMES[d % 7]} walked to the {PLACES[(3 * d) % 7]} and bought {d % 9 + 2} "
                    f"{ITEMS[(5 * d) % 7]} for {(d * 13) % 40 + 5} coins." for d in range(num_days))


def prompt_lengths(num_prompts: int) -> list[int]:
    """300, 311, 322, ...: every residue modulo B comes up (3 in 16 cross a block with the drafts)."""
    return [300 + 11 * i for i in range(num_prompts)]


def prompts(model: WorkerModel, lengths: list[int]) -> list[list[int]]:
    """Cuts of one text at ``lengths`` tokens."""
    ids = model.tokenizer.encode_prompt(diary(80))
    assert len(ids) >= max(lengths), f"the text has {len(ids)} tokens"
    return [ids[:n] for n in lengths]


def engine(model: WorkerModel, role: str) -> LLMEngine:
    config = EngineConfig(model=MODEL, device="cpu", tokens_per_block=B, num_pages=400, max_draft_len=DRAFT_LEN,
                          enable_prefix_caching=False, max_num_batched_tokens=512)
    return LLMEngine(config, role=role, model=model)


def run_aggregated(model: WorkerModel, prompt: list[int], params: SamplingParams) -> list[int]:
    eng = engine(model, "both")
    eng.add_request("r", prompt, params)
    out: list[int] = []
    while eng.has_unfinished():
        for update in eng.step():
            out += update.new_token_ids
    return out


def run_disaggregated(model: WorkerModel, prompt: list[int], params: SamplingParams, plan) -> tuple[list[int], int]:
    """Tokens, and how many groups' generation tables carried a bound block past the slice."""
    context, generation = engine(model, "context"), engine(model, "generation")
    context.prefill("r", prompt, params)
    prefill = next(u.prefill for _ in range(100) for u in context.step() if u.prefill is not None)
    assert generation.reserve_prefilled("r", kv_token_ids(prompt, prefill.output_token_ids))
    num_surplus = 0
    for group in context.manager.spec.groups:
        src = prefill.block_ordinals[group.name]
        dst = generation.manager.get_block_ordinals("r", group.name)
        num_surplus += max(i for i, page in enumerate(dst) if page >= 0) >= math.ceil(prefill.num_kv_tokens / B)
        pages, sources = generation.manager.storage.tensors[group.name], context.manager.storage.tensors[group.name]
        for _, s, d in plan(src, dst, prefill.num_kv_tokens, group.window, B):
            pages[d] = sources[s]
    context.abort("r")
    out = list(generation.add_prefilled("r", prompt, prefill.output_token_ids, params)[0].new_token_ids)
    while generation.has_unfinished():
        for update in generation.step():
            out += update.new_token_ids
    return out, num_surplus


def is_loop(tokens: list[int], tail: int = 24) -> bool:
    """The last ``tail`` tokens are one short n-gram (period <= 6) repeated."""
    end = tokens[-tail:]
    return len(end) == tail and any(all(end[i] == end[i % p] for i in range(tail)) for p in range(1, 7))


def measure(lengths: list[int], max_tokens: int, model: WorkerModel | None = None) -> dict:
    model = model or WorkerModel.load(EngineConfig(model=MODEL, device="cpu"))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for prompt in prompts(model, lengths):
        reference = run_aggregated(model, prompt, params)
        ordinal, _ = run_disaggregated(model, prompt, params, plan_slice)
        counted, num_surplus = run_disaggregated(model, prompt, params, count_based_plan)
        rows.append({"prompt_tokens": len(prompt), "surplus_slices": num_surplus,
                     "ordinal_equal": ordinal == reference, "count_based_equal": counted == reference,
                     "aggregated_loops": is_loop(reference), "count_based_loops": is_loop(counted)})
        print(rows[-1], flush=True)
    return {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "model": MODEL, "draft_len": DRAFT_LEN, "tokens_per_block": B, "max_tokens": max_tokens, "rows": rows,
            "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    return {"requests": len(rows), "slices": 2 * len(rows),
            "slices_with_surplus": sum(r["surplus_slices"] for r in rows),
            "ordinal_diverged": sum(not r["ordinal_equal"] for r in rows),
            "count_based_diverged": sum(not r["count_based_equal"] for r in rows),
            "count_based_loops": sum(r["count_based_loops"] and not r["aggregated_loops"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="bench/results/defect_slice.json")
    args = parser.parse_args()
    result = measure(prompt_lengths(args.num_prompts), args.max_tokens)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
