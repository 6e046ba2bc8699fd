"""bench/gpu_check.sh's dry run on this CPU machine: the script a GPU machine runs stays runnable.

The GPU run itself needs a lent device; the dry run executes the same greedy and
disaggregated checks on cpu (NIXL over host memory), so an API change that breaks
the script fails here rather than on the day a GPU is available.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "PY": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=480)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    summary = dict(re.findall(r"^(\w+)\s+(ok|skipped|FAIL\(\d+\))\s+\d+$", out, re.M))
    assert summary == {"install": "skipped", "versions": "ok", "triton": "skipped", "gpu_tests": "skipped",
                       "greedy": "ok", "graph": "skipped", "serving": "skipped", "disagg": "ok",
                       "bench_transfer": "skipped",
                       "bench_engine_cuda": "skipped", "parity": "skipped"}, out[-2000:]
    logs = tmp_path / "gpu_check"
    greedy = re.findall(r"^drafts=(\d) prompt_len=\s*\d+ identical=(\w+)", (logs / "greedy.log").read_text(), re.M)
    assert len(greedy) == 10 and all(same == "True" for _, same in greedy), greedy
    disagg = re.search(r"^requests=(\d+) identical=(\d+) kv_transfer_bytes=(\d+)", (logs / "disagg.log").read_text(),
                       re.M)
    assert disagg and disagg[1] == disagg[2] and int(disagg[3]) > 0, out[-2000:]
