"""``python -m bench.transfer``: start the actors, cross-check, measure every size, write the figures."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import ray

from bench.common import parse_args, progress, start_ray, torch_threads, write_json, write_plot
from bench.transfer.geometry import (
    DRAFTS,
    DTYPE_BYTES,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PAGE_NBYTES,
    B,
    W,
    build_model,
    min_slice_pages,
    worker_config,
)
from bench.transfer.measure import Bench, measure_size, reps_for
from bench.transfer.report import draw, print_tables
from bench.transfer.workers import BenchGenerationWorker, BufferPeer, SyntheticContextWorker

DESCRIPTION = "The windowed KV slice over NIXL between a context and a generation worker (Ray actors)."
MODES = {
    "full": dict(sizes=(1000, 2000, 4000, 8000, 16000, 32000), real_prefill=(1000, 2000), fragmented_max=8000,
                 min_reps=5, max_reps=21),
    "quick": dict(sizes=(1000, 2000), real_prefill=(1000,), fragmented_max=1000, min_reps=2, max_reps=2),
}


async def start(path: str, mode: dict, device: str) -> Bench:
    """Context, generation and fragmented-generation workers; two buffer peers, connected; all on ``device``."""
    remote = ray.remote(num_cpus=0)  # and num_gpus=0: Ray leaves CUDA_VISIBLE_DEVICES alone, every actor sees the GPU
    largest, frag_largest = max(mode["sizes"]), mode["fragmented_max"]
    ctx = remote(SyntheticContextWorker).remote(worker_config(path, -(-largest // B) + 2, device=device))
    gen = remote(BenchGenerationWorker).remote(worker_config(path, -(-(largest + DRAFTS) // B) + 2, DRAFTS, device))
    frag = remote(BenchGenerationWorker).remote(
        worker_config(path, 2 * (-(-(frag_largest + DRAFTS) // B) + 2), DRAFTS, device))
    sizes = {f"p{p}": sum(min_slice_pages(p)) * PAGE_NBYTES for p in mode["sizes"]}
    src, dst = remote(BufferPeer).remote(sizes, 1, device), remote(BufferPeer).remote(sizes, 2, device)
    await asyncio.gather(*(worker.start.remote() for worker in (ctx, gen, frag)))  # whoever creates one starts it
    await asyncio.gather(ctx.fill_random.remote(0), frag.fragment.remote(), gen.stats.remote())
    (src_name, src_meta), (dst_name, dst_meta) = await src.agent.remote(), await dst.agent.remote()
    await asyncio.gather(dst.connect.remote(src_name, src_meta), src.connect.remote(dst_name, dst_meta))
    return Bench(ctx, gen, frag, src, dst, src_name)


async def cross_check(bench: Bench, sizes: tuple[int, ...]) -> list[dict]:
    """Real prefill vs synthetic pages: the same pages, descriptors and bytes must travel."""
    rows = []
    for prompt_len in sizes:
        progress(f"real prefill of {prompt_len} tokens vs synthetic pages")
        real = await bench.transfer(bench.gen, prompt_len, real=True, verify=True)
        # the KV of the real handoff's num_kv_tokens travels (engine.handoff: more than the prompt when k > 1)
        synthetic = (await bench.transfer(bench.gen, real["num_kv_tokens"], verify=True))["record"]
        real = real["record"]
        fields = ("num_pages", "num_descriptors", "num_bytes")
        rows.append({"prompt_len": prompt_len, **{f"real_{f}": getattr(real, f) for f in fields},
                     **{f"synthetic_{f}": getattr(synthetic, f) for f in fields},
                     "same": all(getattr(real, f) == getattr(synthetic, f) for f in fields)})
        if not rows[-1]["same"]:
            raise AssertionError(f"real and synthetic transfers differ: {rows[-1]}")
    return rows


async def run(path: str, mode: dict, fixed_reps: int | None, device: str) -> dict:
    bench = await start(path, mode, device)
    smallest = min(mode["sizes"])
    await bench.transfer(bench.gen, smallest)  # connects the peers
    await bench.transfer(bench.frag, smallest)
    await bench.buffer_read(f"p{smallest}")
    checks = await cross_check(bench, mode["real_prefill"])
    rows = []
    for prompt_len in mode["sizes"]:
        reps = fixed_reps or reps_for(prompt_len, mode)
        progress(f"P={prompt_len}: {reps} x (slice, single buffer, memcpy"
                 f"{', fragmented' if prompt_len <= mode['fragmented_max'] else ''})")
        rows.append(await measure_size(bench, prompt_len, reps, prompt_len <= mode["fragmented_max"], device))
        r = rows[-1]
        progress(f"  {r['bytes_moved'] / 2**20:.1f} MiB ({r['bytes_ratio']:.2f} x min), {r['pages']} pages in "
                 f"{r['descriptors']} runs, {r['slice_gb_s']:.2f} GB/s = "
                 f"{r['slice_over_buffer']:.2f} x one-buffer read")
    return {"cross_check": checks, "sizes": rows}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(DESCRIPTION, argv, device=True)
    with torch_threads(1):  # one torch thread, as the measurements assume; restored after
        mode = MODES["quick" if args.quick else "full"]
        tmp = tempfile.mkdtemp(prefix="windserve-bench-")
        start_ray(num_cpus=os.cpu_count())
        try:
            path = build_model(os.path.join(tmp, "gptoss-xfer"))
            result = asyncio.run(run(path, mode, args.reps, args.device))
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
        figures = {"mode": "quick" if args.quick else "full", "device": args.device,
                   "reps": args.reps or "per size (reps_for)",
                   "geometry": {"tokens_per_block": B, "window": W, "layers": LAYERS, "kv_heads": KV_HEADS,
                                "head_dim": HEAD_DIM, "dtype_bytes": DTYPE_BYTES, "page_nbytes": PAGE_NBYTES,
                                "generation_draft_len": DRAFTS},
                   **result}
        progress(f"wrote {write_json(args.out, 'transfer', figures)}")
        plot = write_plot(args.out, "transfer", lambda plt: draw(plt, result["sizes"]))
        if plot:
            progress(f"wrote {plot}")
        print_tables(result)
        return figures
