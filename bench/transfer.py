"""The windowed KV slice over NIXL between a context and a generation worker (Ray actors).

    python -m bench.transfer [--quick] [--out bench/out] [--reps N]

Geometry: a random GPT-OSS-shaped model built here (8 layers alternating
window-128 / full, 8 KV heads of 64, float32), B = 32 tokens per page, so a
page is 4 layers x 2 (K, V) x 32 x 8 x 64 x 4 B = 512 KiB per group. The
generation side reserves 3 draft tokens (scratch that never travels).

Per prompt length P (1k .. 32k tokens), measured side by side, reps interleaved:

- bytes moved by ``GenerationWorker.receive_kv`` (its ``ReadStats``) against
  the slice's minimum, computed here from P, W, B and the page size alone
  (must be exactly 1.00), and against a window-unaware transfer (every layer's
  whole prompt);
- its rate against ONE NIXL read of the same bytes in a single buffer (two
  plain actors, ``NixlTransport``, one registered tensor) and against a torch
  memory copy of the same bytes in this process (one thread);
- descriptors: pages before coalescing, runs after; and the same transfer into
  a fragmented generation pool (every other page held), where no page coalesces.

How the context pages are populated: prefilling 32k tokens takes many minutes
on a CPU (attention is quadratic), so a benchmark-only actor subclass binds the
prompt's pages exactly as prefill admission does (``KVCacheManager.allocate`` of
the whole prompt) and grants the same lease; the pages hold random values. The
transfer path (claim, plan, coalesce, NIXL read, release) is the real one. At
the smallest sizes the run also prefills for real and checks that the real
and the synthetic transfer move the same pages, descriptors and bytes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import ray
import torch

from actors.config import WorkerConfig
from actors.context_worker import ContextWorker
from actors.generation_worker import GenerationWorker
from actors.messages import KVHandle
from actors.transport import PageRun, unique_agent_name
from actors.transport.nixl import NixlTransport
from bench.common import (
    ainterleave, build_gptoss_model, median, parse_args, print_table, progress, ratio, start_ray, timed,
    write_json, write_plot,
)
from engine import EngineConfig, SamplingParams

B, W, DRAFTS = 32, 128, 3
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 8, 64, 4
PAGE_NBYTES = (LAYERS // 2) * 2 * B * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # one group holds half the layers
MODES = {
    "full": dict(sizes=(1000, 2000, 4000, 8000, 16000, 32000), real_prefill=(1000, 2000), fragmented_max=8000,
                 min_reps=5, max_reps=21),
    "quick": dict(sizes=(1000, 2000), real_prefill=(1000,), fragmented_max=1000, min_reps=2, max_reps=2),
}
REP_BYTES = 1 << 30  # small transfers are short and noisy: repeat each until ~1 GiB has moved, within the mode's bounds


def build_model(directory: str) -> str:
    return build_gptoss_model(directory, num_hidden_layers=LAYERS, num_attention_heads=KV_HEADS,
                              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=64, intermediate_size=64,
                              num_local_experts=2, num_experts_per_tok=1, sliding_window=W,
                              max_position_embeddings=131072)


def min_slice_pages(prompt_len: int) -> tuple[int, int]:
    """(window group, full group) pages the generation side must receive, from positions alone.

    The first decode query sits at position P and reads keys [P - W + 1, P]
    (window) or [0, P] (full); position P is computed by the generation side.
    So prompt positions max(0, P-W+1) .. P-1 (window) and 0 .. P-1 (full)
    must arrive, in whole pages of B positions.
    """
    last = (prompt_len - 1) // B
    return last - max(0, prompt_len - W + 1) // B + 1, last + 1


def window_unaware_pages(prompt_len: int) -> int:
    return 2 * -(-prompt_len // B)  # both groups send every prompt page


class SyntheticContextWorker(ContextWorker):
    """A ContextWorker that can also hold a prompt's pages without computing them (benchmark only).

    ``hold_synthetic`` binds what admitting a prefill binds (every ordinal of
    the prompt, lowest free pages first) and grants the same lease, so the
    KVHandle, the slice and its page runs are those a prefill would give; a
    prefill then unbinds some stale window pages, which are outside the slice.
    ``cross_check`` compares the two at the smallest sizes.
    """

    async def hold_synthetic(self, request_id: str, prompt_len: int):
        return await self.loop.call(self._hold, request_id, prompt_len)

    def _hold(self, request_id: str, prompt_len: int):
        engine = self.engine
        engine.check_prompt(prompt_len)
        # What the scheduler's admission of a prefill-only request binds (context side: no drafts).
        manager = engine.manager
        manager.allocate(request_id, prompt_len, num_extra_kv_tokens=engine.num_extra_kv_tokens, include_drafts=False)
        return KVHandle(context_agent=self.agent_name, request_id=request_id, prompt_len=prompt_len, first_token_id=0,
                        block_ordinals={g.name: manager.get_block_ordinals(request_id, g.name) for g in manager.spec.groups},
                        lease_deadline=self.leases.grant(request_id), tokens_per_block=manager.spec.tokens_per_block)

    async def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.engine.manager.storage.tensors.values():
            tensor.normal_(generator=generator)

    async def page_sums(self, group: str, pages: list[int]) -> list[float]:
        return _page_sums(self.engine.manager.storage.tensors[group], pages)

    async def num_leases(self) -> int:
        return len(self.leases)


class BenchGenerationWorker(GenerationWorker):
    async def page_sums(self, group: str, pages: list[int]) -> list[float]:
        return _page_sums(self.engine.manager.storage.tensors[group], pages)

    async def fragment(self) -> int:
        """Hold every other page of every pool with one-token requests, so no two free pages are adjacent."""
        manager, count = self.engine.manager, 0
        while manager.can_allocate(1, draft_len=self.engine.draft_len):
            manager.allocate(f"hold-{count}", 1, draft_len=self.engine.draft_len)
            count += 1
        for i in range(0, count, 2):
            manager.free(f"hold-{i}")
        return manager.num_free_pages()


class BufferPeer:
    """A plain actor with one NIXL-registered buffer per size: the single-descriptor baseline."""

    def __init__(self, sizes: dict[str, int], seed: int) -> None:
        torch.set_num_threads(1)
        self.transport = NixlTransport(unique_agent_name("buffer"))
        generator = torch.Generator().manual_seed(seed)
        self.transport.register({name: torch.randint(0, 256, (1, n), dtype=torch.uint8, generator=generator)
                                 for name, n in sizes.items()})

    def agent(self) -> tuple[str, bytes]:
        return self.transport.agent_name, self.transport.metadata()

    def connect(self, name: str, metadata: bytes) -> None:
        self.transport.connect(name, metadata)

    async def read(self, peer: str, name: str) -> float:
        start = time.perf_counter()
        await asyncio.to_thread(self.transport.read, peer, [PageRun(name, 0, 0, 1)])
        return time.perf_counter() - start


def _page_sums(tensor: torch.Tensor, pages: list[int]) -> list[float]:
    return [float(tensor[p].sum(dtype=torch.float64)) for p in pages]


# -- one measurement each ----------------------------------------------------------------------

class Bench:
    """The actors of one run: context, generation, fragmented generation, and the buffer reader."""

    def __init__(self, ctx, gen, frag, buffer_source, buffer_reader, buffer_source_name: str) -> None:
        self.ctx, self.gen, self.frag = ctx, gen, frag
        self.source, self.reader, self.source_name = buffer_source, buffer_reader, buffer_source_name  # a dropped handle ends its actor
        self.count = 0

    async def transfer(self, gen, prompt_len: int, real: bool = False, verify: bool = False) -> dict:
        """One request's KV through ``receive_kv``: its ReadStats plus the wall time the caller saw."""
        rid = f"{'real' if real else 'syn'}-{prompt_len}-{self.count}"
        self.count += 1
        if real:
            prompt = [(7 * i) % 256 for i in range(prompt_len)]
            handle = await self.ctx.prefill.remote(rid, prompt, SamplingParams(max_tokens=1))
        else:
            handle = await self.ctx.hold_synthetic.remote(rid, prompt_len)
        start = time.perf_counter()
        record = await gen.receive_kv.remote(handle)
        wall = time.perf_counter() - start
        if verify:
            await self.verify(gen, handle, rid)
        await gen.abort.remote(rid)
        await self.wait_released()
        return {"record": record, "wall": wall}

    async def verify(self, gen, handle, rid: str) -> None:
        """Every page of the slice holds at its ordinal, on the generation side, what the context side holds."""
        dst_tables = await gen.block_ordinals.remote(rid)
        for group, src_table in handle.block_ordinals.items():
            first = max(0, handle.prompt_len - W + 1) // B if group != "full" else 0
            ordinals = range(first, (handle.prompt_len - 1) // B + 1)
            src = await self.ctx.page_sums.remote(group, [src_table[i] for i in ordinals])
            dst = await gen.page_sums.remote(group, [dst_tables[group][i] for i in ordinals])
            if src != dst:
                raise AssertionError(f"P={handle.prompt_len} group {group}: pages differ after the transfer")

    async def wait_released(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while await self.ctx.num_leases.remote():
            if time.monotonic() > deadline:
                raise TimeoutError("the context worker did not release the transferred pages")
            await asyncio.sleep(0.005)

    async def buffer_read(self, name: str) -> float:
        return await self.reader.read.remote(self.source_name, name)


def reps_for(prompt_len: int, mode: dict) -> int:
    nbytes = sum(min_slice_pages(prompt_len)) * PAGE_NBYTES
    return max(mode["min_reps"], min(mode["max_reps"], round(REP_BYTES / nbytes)))


async def measure_size(bench: Bench, prompt_len: int, reps: int, fragmented: bool) -> dict:
    nbytes = sum(min_slice_pages(prompt_len)) * PAGE_NBYTES
    src, dst = torch.randint(0, 256, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    async def memcpy() -> float:
        return timed(dst.copy_, src)[1]

    candidates = {"slice": lambda: bench.transfer(bench.gen, prompt_len),
                  "buffer": lambda: bench.buffer_read(f"p{prompt_len}"), "memcpy": memcpy}
    if fragmented:
        candidates["fragmented"] = lambda: bench.transfer(bench.frag, prompt_len, verify=True)
    first = await bench.transfer(bench.gen, prompt_len, verify=True)  # checks the content, warms this size up
    await memcpy()
    runs = await ainterleave(reps, candidates)
    return size_row(prompt_len, first["record"], runs, nbytes)


def size_row(prompt_len: int, record, runs: dict[str, list], nbytes: int) -> dict:
    window, full = min_slice_pages(prompt_len)
    slice_s = [r["record"].seconds for r in runs["slice"]]
    row = {
        "prompt_len": prompt_len, "min_pages": {"window": window, "full": full}, "page_nbytes": PAGE_NBYTES,
        "bytes_moved": record.num_bytes, "bytes_min": nbytes, "bytes_ratio": record.num_bytes / nbytes,
        "bytes_window_unaware": window_unaware_pages(prompt_len) * PAGE_NBYTES,
        "window_unaware_over_moved": window_unaware_pages(prompt_len) * PAGE_NBYTES / record.num_bytes,
        "pages": record.num_pages, "descriptors": record.num_descriptors,
        "slice_gb_s": nbytes / median(slice_s) / 1e9,
        "reps": len(slice_s), "receive_kv_wall_ms": median([r["wall"] for r in runs["slice"]]) * 1e3,
        "buffer_gb_s": nbytes / median(runs["buffer"]) / 1e9,
        "memcpy_gb_s": nbytes / median(runs["memcpy"]) / 1e9,
        "slice_over_buffer": median([ratio(b, s) for s, b in zip(slice_s, runs["buffer"])]),
        "slice_over_buffer_best": ratio(min(runs["buffer"]), min(slice_s)),
        "slice_over_memcpy": median([ratio(m, s) for s, m in zip(slice_s, runs["memcpy"])]),
        "slice_seconds": slice_s, "buffer_seconds": runs["buffer"], "memcpy_seconds": runs["memcpy"],
    }
    if "fragmented" in runs:
        frag_s = [r["record"].seconds for r in runs["fragmented"]]
        frag = runs["fragmented"][0]["record"]
        row.update(fragmented_pages=frag.num_pages, fragmented_descriptors=frag.num_descriptors,
                   fragmented_gb_s=nbytes / median(frag_s) / 1e9,
                   fragmented_over_slice=median([ratio(s, f) for s, f in zip(slice_s, frag_s)]))
    return row


# -- setup -------------------------------------------------------------------------------------

def worker_config(path: str, num_pages: int, drafts: int = 0) -> WorkerConfig:
    engine = EngineConfig(model=path, tokens_per_block=B, num_pages=num_pages, max_draft_len=drafts, device="cpu")
    return WorkerConfig(engine=engine, transport="nixl")


async def start(path: str, mode: dict) -> Bench:
    """Context, generation and fragmented-generation workers; two buffer peers, connected."""
    remote = ray.remote(num_cpus=0)
    largest, frag_largest = max(mode["sizes"]), mode["fragmented_max"]
    ctx = remote(SyntheticContextWorker).remote(worker_config(path, -(-largest // B) + 2))
    gen = remote(BenchGenerationWorker).remote(worker_config(path, -(-(largest + DRAFTS) // B) + 2, DRAFTS))
    frag = remote(BenchGenerationWorker).remote(worker_config(path, 2 * (-(-(frag_largest + DRAFTS) // B) + 2), DRAFTS))
    sizes = {f"p{p}": sum(min_slice_pages(p)) * PAGE_NBYTES for p in mode["sizes"]}
    src, dst = remote(BufferPeer).remote(sizes, 1), remote(BufferPeer).remote(sizes, 2)
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
        real = (await bench.transfer(bench.gen, prompt_len, real=True, verify=True))["record"]
        synthetic = (await bench.transfer(bench.gen, prompt_len, verify=True))["record"]
        fields = ("num_pages", "num_descriptors", "num_bytes")
        rows.append({"prompt_len": prompt_len, **{f"real_{f}": getattr(real, f) for f in fields},
                     **{f"synthetic_{f}": getattr(synthetic, f) for f in fields},
                     "same": all(getattr(real, f) == getattr(synthetic, f) for f in fields)})
        if not rows[-1]["same"]:
            raise AssertionError(f"real and synthetic transfers differ: {rows[-1]}")
    return rows


async def run(path: str, mode: dict, fixed_reps: int | None) -> dict:
    bench = await start(path, mode)
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
        rows.append(await measure_size(bench, prompt_len, reps, prompt_len <= mode["fragmented_max"]))
        r = rows[-1]
        progress(f"  {r['bytes_moved'] / 2**20:.1f} MiB ({r['bytes_ratio']:.2f} x min), {r['pages']} pages in "
                 f"{r['descriptors']} runs, {r['slice_gb_s']:.2f} GB/s = {r['slice_over_buffer']:.2f} x one-buffer read")
    return {"cross_check": checks, "sizes": rows}


# -- output ------------------------------------------------------------------------------------

def draw(plt, rows: list[dict]) -> None:
    fig, (rate, size, descriptors) = plt.subplots(1, 3, figsize=(17, 4.5))
    x = [r["prompt_len"] for r in rows]
    rate.plot(x, [r["slice_gb_s"] for r in rows], "o-", label="windowed slice (receive_kv)")
    rate.plot(x, [r["buffer_gb_s"] for r in rows], "s--", label="one NIXL read, one buffer")
    rate.plot(x, [r["memcpy_gb_s"] for r in rows], "^:", label="torch memory copy")
    frag = [r for r in rows if "fragmented_gb_s" in r]
    rate.plot([r["prompt_len"] for r in frag], [r["fragmented_gb_s"] for r in frag], "x-.", label="slice, fragmented pool")
    rate.set(xscale="log", xlabel="prompt tokens", ylabel="GB/s", title="transfer rate (median)")
    rate.legend()
    mib = 2 ** 20
    size.plot(x, [r["bytes_window_unaware"] / mib for r in rows], "s--", label="window-unaware (every layer, whole prompt)")
    size.plot(x, [r["bytes_moved"] / mib for r in rows], "o-", label="moved")
    size.plot(x, [r["bytes_min"] / mib for r in rows], "k.", label="minimum (from P, W, B)")
    size.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="MiB per request", title="bytes per request")
    size.legend()
    descriptors.plot(x, [r["pages"] for r in rows], "s--", label="pages (before coalescing)")
    descriptors.plot(x, [r["descriptors"] for r in rows], "o-", label="runs = descriptors (after)")
    descriptors.plot([r["prompt_len"] for r in frag], [r["fragmented_descriptors"] for r in frag], "x-.",
                     label="runs, fragmented pool")
    descriptors.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="per transfer", title="descriptors")
    descriptors.legend()


def print_tables(result: dict) -> None:
    rows = result["sizes"]
    print_table("windowed KV slice over NIXL (B=32, W=128, 512 KiB pages)",
                ["P", "MiB", "x min", "unaware/moved", "pages", "runs", "slice GB/s", "buffer GB/s", "memcpy GB/s",
                 "slice/buffer", "(best)", "slice/memcpy", "frag runs", "frag/slice"],
                [[r["prompt_len"], r["bytes_moved"] / 2**20, r["bytes_ratio"], r["window_unaware_over_moved"],
                  r["pages"], r["descriptors"], r["slice_gb_s"], r["buffer_gb_s"], r["memcpy_gb_s"],
                  r["slice_over_buffer"], r["slice_over_buffer_best"], r["slice_over_memcpy"], r.get("fragmented_descriptors", "-"),
                  r.get("fragmented_over_slice", "-")] for r in rows])
    print_table("real prefill vs synthetic pages", ["P", "pages", "runs", "bytes", "same"],
                [[c["prompt_len"], c["real_num_pages"], c["real_num_descriptors"], c["real_num_bytes"], c["same"]]
                 for c in result["cross_check"]])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    torch.set_num_threads(1)
    mode = MODES["quick" if args.quick else "full"]
    tmp = tempfile.mkdtemp(prefix="windserve-bench-")
    start_ray()
    try:
        path = build_model(os.path.join(tmp, "gptoss-xfer"))
        result = asyncio.run(run(path, mode, args.reps))
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {"mode": "quick" if args.quick else "full", "reps": args.reps or "per size (reps_for)",
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


if __name__ == "__main__":
    main()
