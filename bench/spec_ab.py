"""Speculative decoding: the draft-length policy against its predecessor, side by side.

    python -m bench.spec_ab [--reps 4] [--quick]

For each rep, both policies in turn (the current one; ``prior_drafts=2``: the
policy before 09d7fb2 (2026-12-03), the engine's recent acceptance weighted as 2 drafts in
a request's estimate instead of 8), each on gptoss-mid and windserve-tiny,
repetitive and random text, batch 1,
``bench.engine_spec.speculative`` (no drafts vs up to 4 n-gram drafts, outputs must be
identical). Prints every wall ratio (no drafts / drafts) and the medians; writes
``spec_ab.json``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile

from bench.common import parse_args, progress, torch_threads, write_json
from bench.engine import MODES
from bench.engine_models import available_models
from bench.engine_spec import speculative

POLICIES = {"current": {}, "previous": {"prior_drafts": 2}}
CASES = (("gptoss-mid", "repetitive"), ("gptoss-mid", "random"),
         ("windserve-tiny", "random"), ("windserve-tiny", "repetitive"))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    mode = MODES["quick" if args.quick else "full"]
    reps = args.reps or (1 if args.quick else 4)
    cases = CASES[2:3] if args.quick else CASES
    ratios: dict[str, dict[str, list[float]]] = {p: {f"{m} {t}": [] for m, t in cases} for p in POLICIES}
    tmp = tempfile.mkdtemp(prefix="windserve-bench-")
    try:
        with torch_threads(1):
            paths = available_models(tuple(dict.fromkeys(m for m, _ in cases)), tmp)
            for rep in range(reps):
                order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
                for policy in order:
                    for model, text in cases:
                        row = speculative(model, paths[model], mode, 1, text, policy=POLICIES[policy])
                        if not row["identical_outputs"]:
                            raise RuntimeError(f"{policy} {model} {text}: drafts changed the output")
                        ratios[policy][f"{model} {text}"].append(row["wall_ratio"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {p: {case: statistics.median(v) for case, v in by_case.items()} for p, by_case in ratios.items()}
    for case in medians["current"]:
        progress(f"{case}: current {medians['current'][case]:.3f}x (runs {_fmt(ratios['current'][case])}), "
                 f"previous {medians['previous'][case]:.3f}x (runs {_fmt(ratios['previous'][case])})")
    figures = {"reps": reps, "wall_ratios": ratios, "medians": medians}
    progress(f"wrote {write_json(args.out, 'spec_ab', figures)}")
    return figures


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    main()
