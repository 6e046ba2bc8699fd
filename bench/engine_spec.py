"""``bench.engine``'s speculative-decoding figures: no drafts against n-gram drafts, one
request at a time, on repetitive and on random text (``bench.spec_ab`` reuses it to put
two draft-length policies side by side)."""

from __future__ import annotations

from bench.common import median, progress, ratio, timed_cpu
from bench.engine_models import make_llm, mixed_prompts, repetitive_prompts
from engine import SamplingParams


def speculative(model: str, path: str, mode: dict, reps: int, text: str, draft_len: int = 4,
                policy: dict | None = None) -> dict:
    """``text``: "repetitive" (n-gram drafts should pay) or "random" (they must not cost: the
    engine's adaptive draft length turns them off where acceptance is low). ``policy``:
    attributes to set on the drafting engine's ``DraftLengthPolicy`` (``bench.spec_ab``)."""
    if text == "repetitive":
        prompts = repetitive_prompts(mode["spec_prompts"])
    else:
        prompts = mixed_prompts(mode["spec_prompts"], (48, 160), seed=3)
    llms = {d: make_llm(path, 1, max(map(len, prompts)), mode["spec_tokens"], max_draft_len=d) for d in (0, draft_len)}
    params = SamplingParams(max_tokens=mode["spec_tokens"], ignore_eos=True)
    for name, value in (policy or {}).items():
        setattr(llms[draft_len].engine.scheduler.draft_policy, name, value)

    def run_one(d: int, prompt: list[int]):
        before = llms[d].engine.runner.num_forward_passes
        outputs, wall, cpu = timed_cpu(llms[d].generate, prompt_token_ids=[prompt], sampling_params=params)
        return outputs[0], wall, cpu, llms[d].engine.runner.num_forward_passes - before

    def rep_pair(rep: int) -> dict[str, tuple]:
        """Both engines prompt by prompt, the order flipped every prompt. Whole runs of 8 prompts
        (1-4 s) one engine after the other moved by +-15% with the host's speed (windserve-tiny
        random text, five runs: 0.81x to 1.15x); per prompt both see the same host."""
        totals = {name: ([], 0.0, 0.0, 0) for name in ("plain", "draft")}
        for i, prompt in enumerate(prompts):
            order = (("plain", 0), ("draft", draft_len)) if (i + rep) % 2 == 0 else (("draft", draft_len), ("plain", 0))
            for name, d in order:
                output, wall, cpu, passes = run_one(d, prompt)
                outs, walls, cpus, total_passes = totals[name]
                totals[name] = (outs + [output], walls + wall, cpus + cpu, total_passes + passes)
        return totals

    for d in llms:  # warm-up, not timed: the process's first forward passes at these shapes cost more
        llms[d].generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    progress(f"speculative {model}: {reps} x (no drafts, {draft_len} drafts) on {len(prompts)} {text} prompts, "
             "one at a time, alternated prompt by prompt")
    pairs = [rep_pair(rep) for rep in range(reps)]
    runs = {name: [pair[name] for pair in pairs] for name in ("plain", "draft")}
    (plain_out, _, _, plain_passes), (draft_out, _, _, draft_passes) = runs["plain"][0], runs["draft"][0]
    num_tokens = sum(len(o.token_ids) for o in plain_out)
    proposed, accepted = sum(o.num_drafts_proposed for o in draft_out), sum(o.num_drafts_accepted for o in draft_out)
    row = {
        "model": model, "text": text, "max_draft_len": draft_len, "num_prompts": len(prompts),
        "output_tokens": num_tokens,
        "identical_outputs": all(a.token_ids == b.token_ids for a, b in zip(plain_out, draft_out)),
        "passes_per_token_plain": plain_passes / num_tokens, "passes_per_token_draft": draft_passes / num_tokens,
        "passes_ratio": ratio(plain_passes, draft_passes),
        "acceptance_rate": ratio(accepted, proposed), "drafts_proposed": proposed, "drafts_accepted": accepted,
        "wall_ratio": median([ratio(p[1], d[1]) for p, d in zip(runs["plain"], runs["draft"])]),
        "wall_ratios": [ratio(p[1], d[1]) for p, d in zip(runs["plain"], runs["draft"])],
        "cpu_ratio": median([ratio(p[2], d[2]) for p, d in zip(runs["plain"], runs["draft"])]),
    }
    progress(f"  {row['passes_ratio']:.2f}x fewer forward passes, acceptance {row['acceptance_rate']:.0%}, "
             f"wall {row['wall_ratio']:.2f}x, identical outputs: {row['identical_outputs']}")
    return row
