"""The GPU decode step's attention API: paged decode attention read in place, and the K/V write.

Both run the Triton kernels (engine.gpu.triton_attention, engine.gpu.triton_kv_write) where Triton
can run them: CUDA tensors with Triton importable and compiling, or CPU tensors where the process's
Triton is its interpreter (``TRITON_INTERPRET=1`` when Triton was first imported: how CI tests the
kernels; see engine.gpu.triton_build). Elsewhere the torch references of engine.gpu.reference run,
with the same semantics (also CUDA tensors in an interpreting process). Both paths are capturable by a CUDA graph:
fixed shapes, no host sync, no allocation whose size depends on the data.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from engine.gpu.reference import reference_decode_attention, reference_write_kv


def paged_decode_attention(query, kv_cache, layer_index, block_tables, table_rows, positions, *,
                           window: int | None, scale: float, sinks=None, out=None,
                           num_splits: int = 1) -> torch.Tensor:
    """Attention of each new token over its request's cached keys, read in place from the pages.

    query [N, Hq, D] (float32 / bf16 / fp16; heads contiguous, rows may be strided);
    kv_cache [num_pages, L, 2, B, Hkv, D] contiguous (0 = K, 1 = V); block_tables [R, M] int32 page ids
    (-1 = unbound); table_rows [N] int32: the row of block_tables token t uses; positions [N] int32/64.
    Token t at position p attends the keys at positions ``max(0, p - W + 1) .. p`` (W = ``window``,
    None = full), position k in page ``block_tables[table_rows[t], k // B]``, slot ``k % B``::

        position   0 ....... p-W+1 ............ p        p+1 ...
        ordinal    k // B: read only from (p-W+1)//B to p//B, each key masked to [p-W+1, p]

    Query head h reads KV head ``h // (Hq // Hkv)``. ``sinks`` [Hq] (GPT-OSS) adds ``exp(sinks[h])``
    to each softmax denominator, with no value. A padded row has ``positions[t] = -1``: it reads
    nothing and its output row is 0. Decode and verify steps alike: a request's 1 + drafts tokens
    have consecutive positions and one table row, their K/V already written (:func:`write_kv`), so
    position p sees the step's other new tokens up to p only.

    The kernel never dereferences a -1 ordinal (its keys count as absent); that every ordinal a
    token reads is bound is the host's check (the graph runner's buffer builder raises), not this
    function's: an unbound ordinal inside a window silently drops its keys. The host also keeps
    ``positions[t] // B < M`` (the table row covers the position): nothing here checks a value,
    which would cost a device-to-host sync.

    ``num_splits > 1``: each token's keys are cut into that many ranges attended separately (more
    programs for few long rows: flash-decoding), then merged by their logsumexps; equal to
    ``num_splits = 1`` within float32 rounding. See :func:`default_num_splits`.
    ``out``: an optional preallocated [N, Hq, D] result (a graph reuses its buffers). Returns the output.
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if _runs_triton(query, kv_cache):
        from engine.gpu.triton_attention import triton_decode_attention

        return triton_decode_attention(query, kv_cache, layer_index, block_tables, table_rows, positions,
                                       window=window, scale=scale, sinks=sinks, out=out, num_splits=num_splits)
    return reference_decode_attention(query, kv_cache, layer_index, block_tables, table_rows, positions,
                                      window=window, scale=scale, sinks=sinks, out=out)


def write_kv(kv_cache, layer_index, slot_mapping, key, value) -> None:
    """The step's new K/V rows into their page slots: token t's key [Hkv, D] into
    ``kv_cache[page, layer_index, 0, offset]``, its value into ``[..., 1, ...]``, where
    ``slot_mapping[t] = page * B + offset`` (int64); -1 (a padded row) writes nothing."""
    if _runs_triton(key, kv_cache):
        from engine.gpu.triton_kv_write import triton_write_kv

        triton_write_kv(kv_cache, layer_index, slot_mapping, key, value)
    else:
        reference_write_kv(kv_cache, layer_index, slot_mapping, key, value)


def default_num_splits(num_tokens: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> int:
    """A split count for a graph of ``num_tokens`` rows whose contexts reach ``max_context_len``.

    The kernel runs one program per (token, KV head, split). Splitting pays when those programs
    leave most of the GPU's ``num_sms`` multiprocessors idle and each split still has enough keys
    to amortise writing its partial result (here at least 512): batch 1 with 8 KV heads at 32k
    keys gets 16 splits; batch 64 gets 1. A guess from how flash-decoding is tuned elsewhere, not
    measured here (no GPU at hand when it was written): measure before trusting the thresholds.
    """
    num_programs = max(1, num_tokens * num_kv_heads)
    if num_programs >= num_sms or max_context_len < 1024:
        return 1
    by_occupancy = -(-2 * num_sms // num_programs)
    by_length = max_context_len // 512
    return int(max(1, min(by_occupancy, by_length, 32)))


def attention_path(device: torch.device | str) -> str:
    """``"triton"`` or ``"reference"``: what :func:`paged_decode_attention` runs for tensors on ``device``."""
    probe = torch.empty(0, device=device)
    return "triton" if _runs_triton(probe, probe) else "reference"


def check_attention_path(path: str, device_type: str, allow_reference: bool) -> None:
    """ValueError where CUDA graphs would capture the torch reference unasked: it gathers every row's whole
    block table (max_num_seqs x max_model_len keys a layer: 64 x 131,072 x Hkv x D floats), which runs out
    of memory at real shapes. The CPU's static path (tests) runs it by design."""
    if path == "reference" and device_type == "cuda" and not allow_reference:
        raise ValueError("Triton cannot run the paged attention here (not installed, or TRITON_INTERPRET set), "
                         "and the torch reference gathers every row's whole block table: install Triton, or set "
                         "allow_reference_attention for small shapes")


def _runs_triton(tensor: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Triton where it can run: CUDA tensors when it compiles, CPU tensors when it interprets. A CPU
    call without TRITON_INTERPRET does not import Triton (which would fix its mode to compiled)."""
    if not _triton_importable():
        return False
    if tensor.is_cuda and kv_cache.is_cuda:
        from engine.gpu.triton_build import is_interpreted

        return not is_interpreted()
    if tensor.device.type != "cpu" or kv_cache.device.type != "cpu":
        return False
    if not _interpreting_asked() and "triton.language" not in sys.modules:
        return False
    from engine.gpu.triton_build import is_interpreted

    return is_interpreted()


def _interpreting_asked() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None
