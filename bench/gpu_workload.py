"""Issue 27's GPU figures beyond bench.engine_cuda's ratios: real models' shapes with random weights,
nano-vllm's workload, and the decode step time at batch 1 and 64.

| model               | architecture | layers | hidden | heads / KV heads x dim | vocab   | as         |
| ------------------- | ------------ | ------ | ------ | ---------------------- | ------- | ---------- |
| smollm2-shape       | Llama        | 30     | 576    | 9 / 3 x 64             | 49,152  | SmolLM2-135M |
| qwen2.5-0.5b-shape  | Qwen2        | 24     | 896    | 14 / 2 x 64            | 151,936 | Qwen2.5-0.5B |

Weights are drawn here (seed 0, transformers' initialisation): nothing is downloaded, and the
step time depends on the shapes, not the values. The tokenizer is windserve-tiny's byte-level one
(prompts are random ids; ids past its vocabulary decode to nothing). ``tiny=True`` (the CPU dry run)
keeps each architecture but shrinks it to 2 layers of 64.

nano-vllm's workload (its bench.py): 256 sequences, each with a prompt of ``randint(100, 1024)``
random ids and ``max_tokens = randint(100, 1024)``, ignore_eos, all submitted at once; the
figure is output tokens / wall seconds. Ours samples at temperature 0.6 as nano-vllm does.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.tiny import ensure_tiny_model

SHAPES = {
    "smollm2-shape": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5)),
    "qwen2.5-0.5b-shape": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6)),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)
TOKENS_PER_BLOCK = 16
WORKLOADS = {"full": dict(num_seqs=256, lengths=(100, 1024)), "tiny": dict(num_seqs=4, lengths=(4, 12))}


def build_shape_model(name: str, directory: str, tiny: bool = False) -> str:
    """A random model of ``name``'s shape (``SHAPES``), saved in bf16 to ``directory``."""
    import transformers

    config_class, model_class, shape = SHAPES[name]
    config = getattr(transformers, config_class)(**{**shape, **(TINY if tiny else {})})
    with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's random state stays as it was
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer_dir = ensure_tiny_model()
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(tokenizer_dir, file), directory)
    return directory


def nano_vllm_requests(num_seqs: int, lengths: tuple[int, int], vocab: int,
                       seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(*lengths))] for _ in range(num_seqs)]
    return [(prompt, SamplingParams(max_tokens=rng.randint(*lengths), temperature=0.6, seed=i, ignore_eos=True))
            for i, prompt in enumerate(prompts)]


def _engine(path: str, requests_tokens: list[int], max_num_seqs: int, device: str, dtype: str) -> LLM:
    """Pages for every sequence at its longest at once (no preemption), as nano-vllm's KV budget allows."""
    num_pages = sum(-(-n // TOKENS_PER_BLOCK) + 1 for n in requests_tokens) + 16
    return LLM(path, device=device, dtype=dtype, tokens_per_block=TOKENS_PER_BLOCK, num_pages=num_pages,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=8192)


def run_nano_vllm_workload(path: str, vocab: int, device: str, dtype: str, workload: dict) -> dict:
    requests = nano_vllm_requests(workload["num_seqs"], workload["lengths"], vocab)
    llm = _engine(path, [len(p) + s.max_tokens for p, s in requests], len(requests), device, dtype)
    llm.generate(prompt_token_ids=[p for p, _ in requests[:2]],
                 sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, not timed
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=[p for p, _ in requests], sampling_params=[s for _, s in requests])
    wall = time.perf_counter() - start  # the outputs are host lists: every GPU step has finished
    num_output = sum(len(o.token_ids) for o in outputs)
    if num_output != sum(s.max_tokens for _, s in requests):
        raise RuntimeError("a sequence stopped before its max_tokens despite ignore_eos")
    return {"sequences": len(requests), "output_tokens": num_output, "seconds": wall, "output_tok_s": num_output / wall}


def decode_step_ms(path: str, batch: int, prompt_len: int, device: str, dtype: str, steps: int = 20) -> dict:
    """Median wall time of ``steps`` decode steps with ``batch`` requests decoding together (each step
    returns host token ids, so it includes its GPU work), after every prompt is prefilled."""
    llm = _engine(path, [prompt_len + 2 * steps + 8] * batch, batch, device, dtype)
    engine = llm.engine
    rng = random.Random(1)
    for i in range(batch):
        engine.add_request(f"d{i}", [rng.randrange(256) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=2 * steps + 4, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started.update(u.request_id for u in engine.step() if u.new_token_ids)
    for _ in range(3):
        engine.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        updates = engine.step()
        times.append(time.perf_counter() - start)
        if len(updates) != batch:
            raise RuntimeError(f"a decode step served {len(updates)} of {batch} requests")
    busy = None
    if device.startswith("cuda"):
        try:
            busy = gpu_busy(engine, max(1, steps // 4))
        except Exception as exc:  # written without a GPU at hand: a profiler surprise must not cost the run
            print(f"GPU busy not measured: {type(exc).__name__}: {exc}", flush=True)
    return {"batch": batch, "prompt_len": prompt_len, "step_ms": statistics.median(times) * 1e3,
            "min_step_ms": min(times) * 1e3, "gpu_busy": busy}


def gpu_busy(engine, steps: int) -> float:
    """The share of ``steps`` decode steps' time the GPU runs a kernel, from torch's profiler (CUPTI's
    kernel records, graph replays included): the union of the kernels' intervals over the span from the
    first to the last event of the window. The profiler slows the host, so this understates the busy
    share of an unprofiled step (a lower bound)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA]
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    return busy_share(kernels, span)


def busy_share(intervals: list[tuple[float, float]], span: float) -> float:
    """The length of the union of ``intervals`` over ``span`` (0 when either is empty)."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered / span if span > 0 else 0.0
