#!/usr/bin/env bash
# One prepared check of windserve on a single CUDA GPU machine (offline: nothing outside it is reachable).
#
#   bash bench/gpu_check.sh            # from anywhere; logs in ${OUT:-bench/out}/gpu_check/
#   GPU_CHECK_VENV=/path/to/venv       # default ~/.cache/windserve/venv-gpu; PIP_* variables reach pip
#   PY=python3 bash bench/gpu_check.sh # no install: PY and its packages as they are (an offline machine
#                                      # whose python3 has CUDA torch, ray and nixl on its PYTHONPATH)
#   GPU_CHECK_STEPS="disagg bench_transfer"  # only these steps (and versions); default: all
#   GPU_CHECK_DEVICE=cpu PY=.venv/bin/python bash bench/gpu_check.sh
#                                      # dry run on a CPU machine (CI runs it: tests/bench/test_gpu_check.py):
#                                      # no install (PY's packages), the greedy and disagg checks on cpu,
#                                      # GPU tests, parity and benchmarks skipped (the test suite runs them on cpu)
#
# Steps, each under its own timeout, each failing loudly (banner + log tail; exit 1 at the end):
#   install       (without PY) a venv (--system-site-packages when the system torch has CUDA: its torch is
#                 kept), pip install -e .[test] (no cpu extra); offline, the already-installed packages are used
#   versions      nvidia-smi, python, torch + CUDA, ray, nixl, transformers
#   triton        pytest tests/engine/gpu: engine.gpu's Triton kernels compiled, on CUDA tensors, against the
#                 float64 softmax with NaN in every unread slot (on the CPU, CI runs them interpreted); then
#                 python -m bench.sampling_gpu: the one-pass sampling kernel vs the torch sampler it replaced
#                 at 256 x 151,936 and 64 x 49,152 (unfiltered, and top-p 0.9), ids checked equal
#   gpu_tests     pytest -m gpu: tests/engine/test_cuda.py (models and engine vs transformers on cuda,
#                 float32 and bf16; disaggregated == aggregated in bf16)
#   greedy        our engine on cuda (drafts 0 and 3) vs transformers generate on cuda: same greedy tokens
#                 (decode steps replayed as CUDA graphs: the engine's default on cuda)
#   graph         pytest -m gpu tests/engine/test_cuda_graphs.py (graph == eager tokens, == transformers, float32;
#                 replayed logits == the plan-based step's), then decode-step times graph vs eager at batch 1 and 64
#   serving       the GPU path under serving traffic (issue 49): the attention the graphs captured (triton or
#                 reference), torch.cuda.memory_reserved before/after capture, the share of decode rows on the
#                 static path under steady arrivals (mixed steps split), and the host's share of a c = 256 step
#                 with the block tables sized for 32k and 131k positions (python -m bench.host_step)
#   disagg        ContextWorker + GenerationWorker as Ray actors, EngineConfig(device="cuda"), NIXL with
#                 VRAM registration; tokens == an AggregatedWorker on cuda (float32 and bf16); KV bytes moved > 0
#   bench_*       python -m bench.transfer --quick --device cuda, python -m bench.engine_cuda --no-shapes
#                 (its real shapes' nano-vllm workload is a run of its own: python -m bench.engine_cuda)
#   parity        tests/engine/test_model_parity.py + test_engine_vs_transformers.py (on this machine's CPU,
#                 under its transformers; last, so a slow CPU costs only this step)
# A short table comes last. Budget: about 5 minutes on an idle machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG_DIR="${OUT:-$ROOT/bench/out}/gpu_check"
WORK="$(mktemp -d)"
mkdir -p "$LOG_DIR"
T0=$(date +%s)
NAMES=(); STATUS=(); SECONDS_TAKEN=(); FAILED=0
PY="${PY:-}"  # the dry run takes PY from the environment
VENV="${GPU_CHECK_VENV:-$HOME/.cache/windserve/venv-gpu}"  # outside the repo: the repo copy stays clean
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
case "$DEVICE" in cuda|cpu) ;; *) echo "GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac

print_table() {
  echo
  echo "== gpu_check summary ($(( $(date +%s) - T0 ))s total; logs in $LOG_DIR) =="
  printf '%-14s %-8s %6s\n' step result seconds
  for i in "${!NAMES[@]}"; do
    printf '%-14s %-8s %6s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECONDS_TAKEN[$i]}"
  done
}

# step NAME TIMEOUT_S REQUIRED(yes|no) CMD...: runs CMD, tees its output to LOG_DIR/NAME.log.
step() {
  local name=$1 limit=$2 required=$3 start rc
  shift 3
  if [[ -n ${GPU_CHECK_STEPS:-} && $name != versions && " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    skipped "$name" "not in GPU_CHECK_STEPS"
    return 0
  fi
  echo; echo "== [$name] (timeout ${limit}s): $*"
  start=$(date +%s)
  set +e
  # bash -c: the exported functions below run under timeout like any command
  timeout --kill-after=15 "$limit" bash -c 'set -euo pipefail; "$@"' "$name" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  NAMES+=("$name"); SECONDS_TAKEN+=("$(( $(date +%s) - start ))")
  if [[ $rc -eq 0 ]]; then
    STATUS+=("ok")
    return 0
  fi
  STATUS+=("FAIL($rc)"); FAILED=1
  {
    echo "!!!!!!!!!! FAILED: step '$name' exit $rc$([[ $rc -eq 124 || $rc -eq 137 ]] && echo ' (TIMEOUT)') !!!!!!!!!!"
    echo "!!!!!!!!!! last lines of $LOG_DIR/$name.log:"
    tail -n 25 "$LOG_DIR/$name.log" | sed 's/^/!!   /'
  } >&2
  if [[ $required == yes ]]; then
    print_table
    echo "a required step failed: stopping here" >&2
    exit 1
  fi
  return 0
}

skipped() {  # skipped NAME WHY
  echo "== [$1] skipped: $2"; NAMES+=("$1"); STATUS+=("skipped"); SECONDS_TAKEN+=(0)
}

versions() {
  "$PY" - <<'EOF'
import importlib, os, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("ray", "nixl", "transformers", "tokenizers", "fastapi", "pydantic", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no __version__)"))
    except Exception as exc:
        print(name, "MISSING:", type(exc).__name__, exc)
if os.environ["DEVICE"] == "cuda" and not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False: this check needs a CUDA GPU")
EOF
}

system_torch_has_cuda() {
  python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

IMPORTS_CHECK='
import torch, ray, nixl, transformers, tokenizers, safetensors, fastapi, pydantic, prometheus_client, yaml
import pytest, hypothesis, httpx, openai
import engine, actors, app
assert torch.cuda.is_available(), "torch in the venv has no CUDA"
print("imports ok; torch", torch.__version__, "cuda", torch.version.cuda)'

install() {
  local venv="$VENV" pip
  if system_torch_has_cuda; then
    echo "system python3 has torch with CUDA: venv with --system-site-packages (its torch is kept)"
    python3 -m venv --system-site-packages "$venv"
  else
    echo "system python3 has no CUDA torch: plain venv; pip's default Linux torch wheel is the CUDA build"
    python3 -m venv "$venv"
  fi
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check --retries 1 --timeout 20)
  if PYTHONPATH="$ROOT" "$venv/bin/python" -c "$IMPORTS_CHECK" 2>/dev/null; then
    echo "every dependency is importable already: installing windserve itself only (no downloads)"
    "${pip[@]}" --no-deps --no-build-isolation -e . || echo "WARNING: editable install failed; using PYTHONPATH" >&2
  elif ! "${pip[@]}" -e ".[test]"; then
    echo "WARNING: pip install -e .[test] failed (offline?); checking the packages already installed" >&2
  fi
  # Installed or not: every import the checks need must work (the repo itself is on PYTHONPATH).
  PYTHONPATH="$ROOT" "$venv/bin/python" -c "$IMPORTS_CHECK"
}

write_greedy_check() {
  cat > "$WORK/greedy.py" <<'EOF'
"""Our engine against transformers' generate on DEVICE (cuda; cpu in a dry run), greedy, same weights."""
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.tiny import ensure_tiny_model

torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
torch.backends.cudnn.allow_tf32 = False
DEVICE = os.environ["DEVICE"]
path = ensure_tiny_model()
generator = torch.Generator().manual_seed(7)
prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (7, 33, 50, 71, 130)]
NUM_TOKENS = 32

llms = {d: LLM(path, device=DEVICE, tokens_per_block=8, max_draft_len=d, dtype="float32") for d in (0, 3)}
assert DEVICE == "cpu" or torch.cuda.memory_allocated() > 0, "the engine put nothing on the GPU"
hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager").to(DEVICE).eval()
expected = []
with torch.inference_mode():
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                          min_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
bad = 0
for draft, llm in llms.items():
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    for prompt, output, want in zip(prompts, outputs, expected):
        same = output.token_ids == want
        first = next((i for i, (a, b) in enumerate(zip(output.token_ids, want)) if a != b), None)
        print(f"drafts={draft} prompt_len={len(prompt):4d} identical={same}" + ("" if same else f" first diff at {first}"))
        bad += not same
sys.exit(f"{bad} outputs differ from transformers on {DEVICE}" if bad else 0)
EOF
}

write_disagg_check() {
  cat > "$WORK/disagg.py" <<'EOF'
"""Disaggregated on DEVICE (cuda: NIXL registers VRAM) == aggregated on DEVICE, token for token."""
import asyncio
import os
import sys
import time
from functools import partial

import ray
import torch

from actors.aggregated_worker import AggregatedWorker
from actors.config import WorkerConfig
from actors.context_worker import ContextWorker
from actors.generation_worker import GenerationWorker
from engine import SamplingParams
from tests.actors.disagg_helpers import disagg_request, random_prompts


def config(transport: str, dtype: str, **engine) -> WorkerConfig:
    return WorkerConfig(device=os.environ["DEVICE"], dtype=dtype, tokens_per_block=8, transport=transport, **engine)


async def aggregated(worker, request_id, prompt, params):
    tokens = []
    async for ref in worker.generate.remote(request_id, prompt, params):
        update = await ref
        if update.finish_reason == "error":
            raise RuntimeError(update.error)
        tokens += update.new_token_ids
    return tokens


async def check(dtype: str, concurrent: bool, drafts: int) -> int:
    """float32: concurrent requests, drafts on the generation side only: float32 output does not depend on
    the batch's shape. bf16 on a GPU does (cuBLAS picks kernels by shape, rounding differs), so there both
    sides run the same shapes: no drafts, one request at a time; any difference is then a wrong page."""
    remote = lambda cls: ray.remote(num_cpus=0, num_gpus=0)(cls)  # noqa: E731 (num_gpus=0: the GPU stays visible)
    ctx = remote(ContextWorker).remote(config("nixl", dtype))
    gen = remote(GenerationWorker).remote(config("nixl", dtype, max_draft_len=drafts))
    agg = remote(AggregatedWorker).remote(config("local", dtype))
    await asyncio.gather(*(w.start.remote() for w in (ctx, gen, agg)))  # whoever creates a worker starts it
    prompts = random_prompts(12, seed=3) + [list(range(200))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    start = time.perf_counter()
    requests = [partial(disagg_request, ctx, gen, f"d{i}", p, params) for i, p in enumerate(prompts)]
    got = await asyncio.gather(*(r() for r in requests)) if concurrent else [await r() for r in requests]
    disagg_s = time.perf_counter() - start
    start = time.perf_counter()
    want = [await aggregated(agg, f"a{i}", p, params) for i, p in enumerate(prompts)]
    agg_s = time.perf_counter() - start
    stats = await gen.stats.remote()
    bad = sum(g != w for g, w in zip(got, want))
    print(f"requests={len(prompts)} identical={len(prompts) - bad} kv_transfer_bytes={stats.get('kv_transfer_bytes')} "
          f"disagg_s={disagg_s:.2f} ({'concurrent' if concurrent else 'one by one'}) aggregated_s={agg_s:.2f} "
          f"(one by one) dtype={dtype} generation_drafts={drafts}")
    await asyncio.sleep(1.0)  # the context side frees a request's pages once the generation side releases them
    leaked = 0
    for name, worker in (("context", ctx), ("generation", gen), ("aggregated", agg)):
        s = await worker.stats.remote()
        leaked += s["num_free_pages"] != s["num_total_pages"]
        print(name, {k: s.get(k) for k in ("num_free_pages", "num_total_pages", "kv_transfer_bytes")})
    for worker in (ctx, gen, agg):
        ray.kill(worker)
    if bad or leaked or not stats.get("kv_transfer_bytes"):
        print(f"FAIL ({dtype}): {bad} outputs differ, {leaked} workers hold pages, or no KV moved", file=sys.stderr)
        return 1
    return 0


async def main() -> int:
    failed = 0
    for dtype in os.environ.get("DISAGG_DTYPES", "float32").split():
        failed += await check(dtype, concurrent=dtype == "float32", drafts=2 if dtype == "float32" else 0)
    return 1 if failed else 0


assert os.environ["DEVICE"] == "cpu" or torch.cuda.is_available()
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
try:
    sys.exit(asyncio.run(asyncio.wait_for(main(), timeout=240)))
finally:
    ray.shutdown()
EOF
}

write_graph_check() {
  cat > "$WORK/graph_timing.py" <<'EOF'
"""Decode-step time on DEVICE eager (enforce_eager), with CUDA graphs, and with graphs and overlapped steps
(async_scheduling), windserve-tiny, batch 1 and 64."""
import os
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.tiny import ensure_tiny_model

torch.backends.cuda.matmul.allow_tf32 = False
DEVICE = os.environ["DEVICE"]
path = ensure_tiny_model()
generator = torch.Generator().manual_seed(5)
params = SamplingParams(max_tokens=48, ignore_eos=True)


def decode_step_ms(llm: LLM, batch: int) -> float:
    """Median wall time of the steps that ran the static path (decode steps only)."""
    engine, static = llm.engine, llm.engine.runner.static
    for i in range(batch):
        engine.add_request(f"t{batch}-{i}", torch.randint(0, 256, (32,), generator=generator).tolist(), params)
    times = []
    while engine.has_unfinished():
        before, start = static.num_steps, time.perf_counter()
        engine.step()
        if static.num_steps > before:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


MODES = {"eager": dict(enforce_eager=True), "graph": dict(async_scheduling=False),
         "graph_async": dict(async_scheduling=True)}
for dtype in ("float32", "bfloat16"):
    results = {}
    for mode, options in MODES.items():
        llm = LLM(path, device=DEVICE, dtype=dtype, tokens_per_block=16, max_num_seqs=64, use_static_buffers=True,
                  **options)
        graphs = llm.engine.runner.static.graphs
        if graphs is not None:
            print(f"dtype={dtype} captured {graphs.stats['num_graphs']} graphs in {graphs.stats['capture_s']:.2f} s, "
                  f"{graphs.stats['memory_bytes'] / 2**20:.1f} MiB")
        decode_step_ms(llm, 4)  # warm up
        for batch in (1, 64):
            results[mode, batch] = decode_step_ms(llm, batch)
    for batch in (1, 64):
        eager_ms, graph_ms, async_ms = (results[mode, batch] for mode in MODES)
        print(f"graph_timing dtype={dtype} batch={batch} eager_ms={eager_ms:.3f} graph_ms={graph_ms:.3f} "
              f"graph_async_ms={async_ms:.3f} speedup={eager_ms / graph_ms:.2f}x async/graph={graph_ms / async_ms:.2f}x")
EOF
}

triton_check() {  # the sampling timings run even where a test failed; the step fails if either did
  local rc=0
  "$PY" -m pytest -q -p no:cacheprovider tests/engine/gpu || rc=$?
  for top_p in 1.0 0.9; do
    "$PY" -m bench.sampling_gpu --top-p "$top_p" --out "$LOG_DIR/bench" || rc=$?
  done
  return "$rc"
}

graph_check() {
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda_graphs.py
  "$PY" "$WORK/graph_timing.py"
}

write_serving_check() {
  cat > "$WORK/serving.py" <<'EOF'
"""windserve-tiny on DEVICE (bf16, graphs, overlapped steps): what the graphs captured and the memory their
capture reserved, then a prompt every 4 steps for 400 steps (32..511 tokens, 64 outputs each): how many
decode rows ran the static path (a mixed step's decode rows included)."""
import os

import torch

from engine import LLM, SamplingParams
from engine.tiny import ensure_tiny_model

llm = LLM(ensure_tiny_model(), device=os.environ["DEVICE"], tokens_per_block=16, max_num_seqs=64,
          max_num_batched_tokens=512)
engine, static = llm.engine, llm.engine.runner.static
stats = static.graphs.stats
print(f"serving attention={static.attention} graphs={stats['num_graphs']} "
      f"reserved_before_mib={stats['reserved_before'] / 2**20:.1f} reserved_after_mib={stats['reserved_after'] / 2**20:.1f} "
      f"capture_free_lost_mib={stats['memory_bytes'] / 2**20:.1f}")
generator = torch.Generator().manual_seed(9)
params = SamplingParams(max_tokens=64, ignore_eos=True)
for step in range(2000):
    if step < 400 and step % 4 == 0:
        length = int(torch.randint(32, 512, (1,), generator=generator))
        engine.add_request(f"a{step}", torch.randint(0, 256, (length,), generator=generator).tolist(), params)
    elif step >= 400 and not engine.has_unfinished():
        break
    engine.step()
s = engine.stats()
print(f"serving arrivals decode_rows={s['num_decode_rows']} static_decode_rows={s['num_static_decode_rows']} "
      f"static_share={s['num_static_decode_rows'] / max(1, s['num_decode_rows']):.3f} "
      f"split_steps={engine.runner.num_split_steps} launched_ahead={s['num_steps_launched_ahead']}")
EOF
}

serving_check() {
  "$PY" "$WORK/serving.py"
  for positions in 32768 131072; do  # the host's share of a c = 256 step, tables sized for long contexts
    "$PY" -m bench.host_step --concurrency 256 --max-model-len "$positions" --out "$LOG_DIR/bench/host_step_$positions"
  done
}

bench_module() {  # bench_module NAME [ARGS...]: python -m bench.NAME ARGS, with --device cuda when it takes one
  local name=$1 extra=()
  shift
  if "$PY" -m "bench.$name" --help 2>/dev/null | grep -q -- '--device'; then extra=(--device "$DEVICE"); fi
  "$PY" -m "bench.$name" "$@" --out "$LOG_DIR/bench" ${extra[@]+"${extra[@]}"}
}

echo "== gpu_check in $ROOT, $(date -u), $(uname -srm)"
if [[ $DEVICE == cuda ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "WARNING: nvidia-smi failed" >&2
fi
python3 -V || { echo "no python3 on this machine" >&2; exit 1; }
export ROOT LOG_DIR PY VENV IMPORTS_CHECK DEVICE
export -f versions system_torch_has_cuda install bench_module triton_check graph_check serving_check
if [[ $DEVICE == cuda && -z $PY ]]; then
  step install 240 yes install
  PY="$VENV/bin/python"
else
  PY="${PY:-python3}"
  skipped install "PY given: $PY and its packages as they are"
fi
export PY PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" RAY_DEDUP_LOGS=0
export DISAGG_DTYPES="${DISAGG_DTYPES:-float32$([[ $DEVICE == cuda ]] && echo ' bfloat16')}"
step versions 60 yes versions
if [[ $DEVICE == cuda ]]; then
  step triton 300 no triton_check
else
  skipped triton "dry run: CI runs tests/engine/gpu under Triton's interpreter"
fi
if [[ $DEVICE == cuda ]]; then
  step gpu_tests 180 no "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda.py
else
  skipped gpu_tests "dry run: no CUDA (the tests skip themselves)"
fi
write_greedy_check
step greedy 150 no "$PY" "$WORK/greedy.py"
if [[ $DEVICE == cuda ]]; then
  write_graph_check
  export WORK
  step graph 240 no graph_check
else
  skipped graph "dry run: tests/engine/test_static_step.py runs the static path eagerly on cpu"
fi
if [[ $DEVICE == cuda ]]; then
  write_serving_check
  export WORK
  step serving 300 no serving_check
else
  skipped serving "dry run: tests/engine/test_mixed_static.py and tests/engine/gpu run its checks on cpu"
fi
write_disagg_check
step disagg 270 no "$PY" "$WORK/disagg.py"
for bench in "transfer --quick" "engine_cuda --no-shapes"; do  # engine_cuda's full mode: c up to 64, two models, two dtypes
  name=${bench%% *}
  if [[ $DEVICE == cpu ]]; then
    skipped "bench_$name" "dry run: tests/bench runs the benchmarks' smoke tests"
  elif "$PY" -m "bench.$name" --help >/dev/null 2>&1; then
    step "bench_$name" 180 no bench_module $bench
  else
    skipped "bench_$name" "python -m bench.$name is not there"
  fi
done
if [[ $DEVICE == cuda ]]; then
  step parity 150 no "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/engine/test_model_parity.py tests/engine/test_engine_vs_transformers.py
else
  skipped parity "dry run: the test suite runs these on cpu"
fi
grep -h -E '^(drafts=|requests=|graph_timing|dtype=|serving |sampling |c=)' "$LOG_DIR"/triton.log \
  "$LOG_DIR"/greedy.log "$LOG_DIR"/graph.log \
  "$LOG_DIR"/serving.log "$LOG_DIR"/disagg.log 2>/dev/null || true
print_table
rm -rf "$WORK"
if [[ $FAILED -ne 0 ]]; then
  echo "gpu_check: FAILED (see the banners above)" >&2
  exit 1
fi
echo "gpu_check: all steps passed (device $DEVICE)"
