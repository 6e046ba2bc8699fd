"""One measurement each: a transfer through ``receive_kv``, a single-buffer NIXL read, a memory copy.

Per prompt length, the candidates alternate rep by rep (``bench.common.ainterleave``);
``size_row`` turns their times and the first transfer's ``ReadStats`` into figures.
"""

from __future__ import annotations

import asyncio
import time

import torch

from bench.common import ainterleave, median, ratio, synchronized, timed
from bench.transfer.geometry import PAGE_NBYTES, B, W, min_slice_pages, window_unaware_pages
from engine import SamplingParams
from engine.handoff import HANDOFF_MAX_TOKENS

REP_BYTES = 1 << 30  # small transfers are short and noisy: repeat each until ~1 GiB has moved, within the mode's bounds
HELD = SamplingParams(max_tokens=HANDOFF_MAX_TOKENS + 1, ignore_eos=True)  # one that ends in its handoff holds none


class Bench:
    """The actors of one run: context, generation, fragmented generation, and the buffer reader."""

    def __init__(self, ctx, gen, frag, buffer_source, buffer_reader, buffer_source_name: str) -> None:
        self.ctx, self.gen, self.frag = ctx, gen, frag
        # Kept: a dropped handle ends its actor.
        self.source, self.reader, self.source_name = buffer_source, buffer_reader, buffer_source_name
        self.count = 0

    async def transfer(self, gen, prompt_len: int, real: bool = False, verify: bool = False) -> dict:
        """One request's KV through ``receive_kv``: its ReadStats plus the wall time the caller saw."""
        rid = f"{'real' if real else 'syn'}-{prompt_len}-{self.count}"
        self.count += 1
        if real:
            prompt = [(7 * i) % 256 for i in range(prompt_len)]
            handle = (await self.ctx.prefill.remote(rid, prompt, HELD)).kv
        else:
            handle = await self.ctx.hold_synthetic.remote(rid, prompt_len)
        start = time.perf_counter()
        record = await gen.receive_kv.remote(handle)
        wall = time.perf_counter() - start
        if verify:
            await self.verify(gen, handle, rid)
        await gen.abort.remote(rid)
        await self.wait_released()
        return {"record": record, "wall": wall, "num_kv_tokens": handle.num_kv_tokens}

    async def verify(self, gen, handle, rid: str) -> None:
        """Every page of the slice holds at its ordinal, on the generation side, what the context side holds."""
        dst_tables = await gen.block_ordinals.remote(rid)
        for group, src_table in handle.block_ordinals.items():
            first = max(0, handle.num_kv_tokens - W + 1) // B if group != "full" else 0
            ordinals = range(first, (handle.num_kv_tokens - 1) // B + 1)
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


async def measure_size(bench: Bench, prompt_len: int, reps: int, fragmented: bool, device: str = "cpu") -> dict:
    nbytes = sum(min_slice_pages(prompt_len)) * PAGE_NBYTES
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
    dst, sync = torch.empty_like(src), synchronized(device)

    def copy() -> None:
        dst.copy_(src)
        sync()

    async def memcpy() -> float:  # within one device (host memory, or the GPU's)
        sync()
        return timed(copy)[1]

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
