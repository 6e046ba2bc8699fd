"""What bench.planner_served checks in a served run's records: the planner's decisions (its log lines),
the stats board's samples of the worker replicas, and the client's outcomes."""

from __future__ import annotations

import datetime
import glob
import os
import re
from pathlib import Path

from bench.planner_load import Outcome

LOG_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+).*planner: (.*) -> P=(\d+) D=(\d+) \((.*)\)")


def planner_lines(session_dir: str) -> list[dict]:
    """The planner's decisions, from Serve's controller log (app.planner_core logs one line each)."""
    decisions = []
    for path in sorted(glob.glob(os.path.join(session_dir, "logs", "serve", "controller_*.log"))):
        for line in Path(path).read_text(errors="replace").splitlines():
            match = LOG_LINE.search(line)
            if match:
                stamp, inputs, p, d, reason = match.groups()
                when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                fields = dict(pair.split("=", 1) for pair in inputs.split() if "=" in pair)
                decisions.append({"t": when, "P": int(p), "D": int(d), "reason": reason, **fields})
    return decisions


def running_at(samples: list[dict], t: float) -> dict[str, set[str]]:
    """The replicas the board listed, by role, in the sample nearest before ``t``."""
    before = [s for s in samples if s["t"] <= t and "replicas" in s]
    if not before:
        return {}
    roles: dict[str, set[str]] = {}
    for replica in before[-1]["replicas"]:
        roles.setdefault(replica["role"], set()).add(replica["name"])
    return roles


def removals(samples: list[dict], decisions: list[dict], outcomes: list[Outcome]) -> list[dict]:
    """Each replica that left the board: the decision that removed it, and the requests it held then."""
    listed = [s for s in samples if "replicas" in s]
    last_seen: dict[str, tuple[float, str]] = {}
    ids: dict[str, set[str]] = {}
    running_max: dict[str, int] = {}
    for sample in listed:
        for r in sample["replicas"]:
            last_seen[r["name"]] = (sample["t"], r["role"])
            ids.setdefault(r["name"], set()).update(r["ids"])
    final = {r["name"] for r in listed[-1]["replicas"]} if listed else set()
    by_id = {o.request_id: o for o in outcomes if o.request_id}
    out = []
    for name, (gone_after, role) in last_seen.items():
        if name in final:
            continue
        key = "P" if role == "context" else "D"
        shrinking = [d for d in decisions if d["t"] <= gone_after and _previous(decisions, d, key) > d[key]]
        decided = shrinking[-1]["t"] if shrinking else None
        held = [by_id[i] for i in ids[name] if i in by_id and decided is not None
                and _on_role(by_id[i], role)[0] <= gone_after and _on_role(by_id[i], role)[1] >= decided]
        for sample in listed:
            for r in sample["replicas"]:
                if r["name"] == name and decided is not None and sample["t"] >= decided:
                    running_max[name] = max(running_max.get(name, 0), r["num_running"])
        out.append({"replica": name, "role": role, "decided_s": decided, "last_listed_s": gone_after,
                    "running_after_decision_max": running_max.get(name, 0),
                    "in_flight_during_removal": len(held), "in_flight_completed": sum(o.is_complete for o in held),
                    "in_flight_ids": sorted(o.request_id for o in held)})
    return out


def _on_role(outcome: Outcome, role: str) -> tuple[float, float]:
    """When a request was at a replica of ``role``: a context replica from its send to its first token
    (the prefill; its lease is pulled right after), a generation replica from then to its end."""
    first = outcome.first_s or outcome.end_s
    return (outcome.start_s, first) if role == "context" else (first, outcome.end_s)


def _previous(decisions: list[dict], decision: dict, key: str) -> int:
    index = decisions.index(decision)
    return decisions[index - 1][key] if index else decision[key]


def direction_checks(decisions: list[dict], start: float, starts: dict[str, float], interval_s: float,
                     phases: list[str]) -> list[dict]:
    """For each phase, the first decision after it began that moved P:D its way (A and C: more context
    relative to generation; B: more generation), and how many intervals that took."""
    checks = []
    for phase in phases:
        began = start + starts[phase]
        before = [d for d in decisions if d["t"] <= began]
        p0, d0 = (before[-1]["P"], before[-1]["D"]) if before else (1, 1)
        wants_context = phase != "B"
        moved = [d for d in decisions if d["t"] > began and
                 ((d["P"] - p0 > 0 or d0 - d["D"] > 0) if wants_context else (d["D"] - d0 > 0 or p0 - d["P"] > 0))]
        first = moved[0] if moved else None
        after = None if first is None else (first["t"] - began) / interval_s
        moved_to = None if first is None else f"{first['P']}:{first['D']}"
        checks.append({"phase": phase, "from": f"{p0}:{d0}", "to": moved_to,
                       "intervals_after_shift": None if after is None else round(after, 2),
                       "within_two_intervals": after is not None and after <= 2.0})
    return checks


def cold_checks(decisions: list[dict], samples: list[dict]) -> dict:
    """Decisions taken while a replica was in its first interval: the log's warm count is below the running
    count there, so that replica's latency was left out (app.planner's rule)."""
    sized = [d for d in decisions if d["reason"].startswith("sized")]
    with_cold, counted_cold = 0, 0
    for d in sized:
        roles = running_at(samples, d["t"])
        warm = [int(w) if w.isdigit() else 0 for w in d.get("warm", "-/-").split("/")]
        running = [len(roles.get("context", ())), len(roles.get("generation", ()))]
        if any(r > w for r, w in zip(running, warm)):
            with_cold += 1
        if any(w > r for r, w in zip(running, warm)):
            counted_cold += 1
    holds = sum(1 for d in decisions if "loading" in d["reason"])
    return {"sized_decisions": len(sized), "with_a_cold_replica_left_out": with_cold,
            "warm_count_above_running": counted_cold, "holds_while_loading": holds}
