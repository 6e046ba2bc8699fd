"""CUDA graphs of a static step's forward, one per padded batch size, replayed over fixed buffers.

Captured once, when the engine starts: largest size first, every graph in one memory pool (the
pool's blocks are reused by the smaller sizes, as vLLM and nano-vllm do), every warm-up and capture on
one side stream (cuBLAS keeps a workspace per handle and stream, 32 MiB on Hopper: a stream per size
held one per size). Each capture logs the attention it recorded (``triton`` or ``reference``), and
``stats`` keeps torch.cuda.memory_reserved before and after. At capture the buffers
hold only padding (positions -1, slots -1), so capturing writes no page. A replay runs the kernels
the capture recorded, over the addresses it recorded: the buffers must be refilled in place
(engine.gpu.step_buffers), never reallocated.

The logits of every size live in one [largest, V] tensor, the largest graph's own output: each smaller
graph ends by copying its [size, V] rows into the head of it (one small copy kernel), so its output is
a temporary the pool reuses, not a tensor held for the engine's lifetime. Kept per size they held the
sum of all sizes' rows: 4.6x the largest with 64 tokens a step, 9.0x with 256 (64 sequences, 3 drafts);
float32 logits at GPT-OSS's 201k vocabulary 0.24 GB against 0.05, and 1.86 GB against 0.21. So a
replay's logits are overwritten by the next replay of any size: read them before the next step (the
engine samples them in the same step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class CudaGraphs:
    """``forward(n)`` -> logits [n, V] over the static buffers, captured per size in ``sizes``."""

    def __init__(self, forward: Callable[[int], torch.Tensor], sizes: list[int], device: torch.device,
                 attention: str = "triton") -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.device = device
        self.attention = attention  # what paged_decode_attention runs on this device: logged per capture
        self.stream = torch.cuda.Stream(device)  # every warm-up and capture: one cuBLAS workspace, not one a size
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.stats: dict[str, float] = {}

    @torch.inference_mode()
    def capture(self) -> dict[str, float]:
        """Capture every size; returns (and logs) the seconds it took and the device memory it holds:
        ``memory_bytes`` (free memory lost), ``reserved_before`` / ``reserved_after`` / ``reserved_bytes``
        (torch.cuda.memory_reserved: the caching allocator's share, the pool included)."""
        with torch.cuda.device(self.device):  # cuda:N: the side stream, pool and Triton launches on N
            torch.cuda.synchronize(self.device)
            free_before, reserved_before = torch.cuda.mem_get_info(self.device)[0], torch.cuda.memory_reserved(
                self.device)
            start = time.perf_counter()
            self._capture_all()
            torch.cuda.synchronize(self.device)
        reserved_after = torch.cuda.memory_reserved(self.device)
        self.stats = {
            "num_graphs": len(self.graphs),
            "capture_s": time.perf_counter() - start,
            "memory_bytes": free_before - torch.cuda.mem_get_info(self.device)[0],
            "reserved_before": reserved_before, "reserved_after": reserved_after,
            "reserved_bytes": reserved_after - reserved_before,
        }
        logger.info("captured %d CUDA graphs (sizes %s, %s attention) in %.2f s, %.1f MiB (reserved %.1f -> %.1f)",
                    len(self.graphs), self.sizes, self.attention, self.stats["capture_s"],
                    self.stats["memory_bytes"] / 2**20, reserved_before / 2**20, reserved_after / 2**20)
        return self.stats

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        shared: torch.Tensor | None = None  # the largest size's logits: every size's rows, at its head
        for size in reversed(self.sizes):
            self._warm_up(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                logits = self.forward(size)
                if shared is None:
                    shared = logits
                else:
                    shared[:size].copy_(logits)
            self.graphs[size] = (graph, shared[:size])
            logger.info("captured the CUDA graph of %d tokens on %s, %s attention", size, self.device, self.attention)

    def _warm_up(self, size: int) -> None:
        """One eager run on the side stream first: lazy initialisation (cuBLAS handles, Triton compiles,
        allocator growth) must not happen inside a capture."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.forward(size)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def has(self, size: int) -> bool:
        return size in self.graphs

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size`` over the buffers' current contents; its logits [size, V] (a view of the
        shared logits: valid until the next replay of any size)."""
        graph, logits = self.graphs[size]
        graph.replay()
        return logits
