"""engine.gpu.sampling's draw in one pass of Triton: one program per row walks the vocabulary in blocks and
keeps a running argmax, so the logits are read once and nothing [N, V] is written::

    row n:   key = mix(seed_lo ^ mix(seed_hi ^ mix(counter)))              (once, in registers)
    block:   u   = ((mix(key ^ mix(v + GOLDEN)) >> 8) + 0.5) / 2**24, at most the float below 1
             score[v] = logits[v] / T + g(u)     if T > 0 and v passes the row's cut, -inf if it does not
             score[v] = logits[v]                if T == 0 (greedy)
             best[lane], best_id[lane] <- score, v  where score > best   (strict: the lower id keeps a tie)
    end:     the lowest best_id among the lanes holding the row's max

The arithmetic is the torch ops' (``log_f32``, ``uniform_noise``, ``gumbel_noise``), op for op: hashes in
uint32 (wrapping = their ``& 0xFFFFFFFF``), divisions by ``tl.div_rn`` (Triton's ``/`` on float32 is
an approximate ``div.full``) and no fused multiply-add (``enable_fp_fusion=False``), so the ids equal
``sample_tokens``' torch path on the same logits, bit for bit. Top-k / top-p rows arrive with their
``top_cut`` (value, id) pair, found by torch's sort beforehand; unfiltered rows need no pair.

Few rows leave most of the GPU idle (one row of 151,936 tokens is one program), so a row's vocabulary
may be split: program (row, split) walks its share of the blocks and writes its (max, lowest id); a
second program per row takes the max of those and, among the splits holding it, the lowest id: the
same token as one pass, ties included.
"""

from __future__ import annotations

import torch
import triton.language as tl

from engine.gpu import sampling
from engine.gpu.sampling import SamplingRows
from engine.gpu.triton_build import jitted

_M0 = tl.constexpr(sampling._MULTIPLIERS[0])
_M1 = tl.constexpr(sampling._MULTIPLIERS[1])
_GOLDEN = tl.constexpr(sampling._GOLDEN)
_LN2 = tl.constexpr(sampling.LN2)
_SQRT2 = tl.constexpr(sampling.SQRT2)
_C3, _C5, _C7, _C9 = (tl.constexpr(c) for c in sampling.ATANH_SERIES)
_ONE_BELOW = tl.constexpr(sampling.ONE_BELOW)
_INV_2_24 = tl.constexpr(1.0 / (1 << 24))
BLOCK = 1024  # tokens a program holds at once (a 151,936 vocabulary: 149 blocks a row)


def triton_sample_tokens(logits: torch.Tensor, rows: SamplingRows, cut: tuple[torch.Tensor, torch.Tensor] | None,
                         num_splits: int | None = None) -> torch.Tensor:
    """engine.gpu.sampling.sample_tokens' ids [N] (int64) for logits [N, V] (any float dtype, last dim
    contiguous); ``cut``: ``top_cut``'s per-row (value, id) for a step with top-k/top-p rows, else None.
    ``num_splits``: programs per row (None: ``default_num_splits``)."""
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(BLOCK, max(16, 1 << (vocab_size - 1).bit_length()))
    num_blocks = -(-vocab_size // block)
    if num_splits is None:
        num_splits = default_num_splits(num_rows, num_blocks, logits.device)
    blocks_per_split = -(-num_blocks // max(1, min(num_splits, num_blocks)))
    num_splits = -(-num_blocks // blocks_per_split)  # no split without a block
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    part_max, part_id = out, out  # unwritten with one split
    if num_splits > 1:
        part_max = torch.empty(num_rows, num_splits, dtype=torch.float32, device=out.device)
        part_id = torch.empty(num_rows, num_splits, dtype=torch.int32, device=out.device)
    cut_value, cut_id = cut if cut is not None else (rows.temperature, rows.counters)  # unread without a cut
    jitted(_sample_body)[(num_rows, num_splits)](
        logits, logits.stride(0), rows.temperature, rows.seed_lo, rows.seed_hi, rows.counters,
        cut_value.float().contiguous(), cut_id.int().contiguous(), out, part_max, part_id, vocab_size,
        blocks_per_split * block, HAS_CUT=cut is not None, NUM_SPLITS=num_splits, BLOCK=block, enable_fp_fusion=False)
    if num_splits > 1:
        jitted(_combine_body)[(num_rows,)](part_max, part_id, out, vocab_size, NUM_SPLITS=num_splits,
                                           SPLITS_BLOCK=max(2, 1 << (num_splits - 1).bit_length()))
    return out


def default_num_splits(num_rows: int, num_blocks: int, device: torch.device) -> int:
    """Splits so that rows x splits fill the GPU about twice over (1 from 2 x SMs rows up), never fewer
    than 4 blocks a split. A guess, like engine.gpu.paged_attention's: measure before trusting it."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * num_sms // max(1, num_rows)), num_blocks // 4, 64))


def _mix_body(x):
    """engine.gpu.sampling._mix on uint32 values."""
    x = x ^ (x >> 16)
    x = x * _M0
    x = x ^ (x >> 16)
    x = x * _M1
    return x ^ (x >> 15)


def _log_body(x):
    """engine.gpu.sampling.log_f32, op for op."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    is_high = mantissa > _SQRT2
    mantissa = tl.where(is_high, mantissa * 0.5, mantissa)
    exponent = exponent + is_high.to(tl.int32)
    s = tl.div_rn(mantissa - 1.0, mantissa + 1.0)
    z = s * s
    series = ((z * _C9 + _C7) * z + _C5) * z + _C3
    series = series * z
    two_s = s + s
    return exponent.to(tl.float32) * _LN2 + (two_s + two_s * series)


def _gumbel_body(key, ids):
    """engine.gpu.sampling.gumbel_noise for one row's ``key`` (uint32) and token ``ids`` (int32)."""
    bits = _mix(key ^ _mix(ids.to(tl.uint32) + _GOLDEN)) >> 8
    u = tl.minimum((bits.to(tl.float32) + 0.5) * _INV_2_24, _ONE_BELOW)
    return -_log(-_log(u))


_mix = jitted(_mix_body)  # triton_build fixed the mode when it imported Triton: decorating now is safe
_log = jitted(_log_body)
_gumbel = jitted(_gumbel_body)


def _sample_body(logits_ptr, row_stride, temperature_ptr, seed_lo_ptr, seed_hi_ptr, counters_ptr, cut_value_ptr,
                 cut_id_ptr, out_ptr, part_max_ptr, part_id_ptr, vocab_size, split_len, HAS_CUT: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    is_sampled = temperature > 0
    divisor = tl.where(is_sampled, temperature, 1.0)
    seed_lo = tl.load(seed_lo_ptr + row).to(tl.uint32)
    seed_hi = tl.load(seed_hi_ptr + row).to(tl.uint32)
    key = _mix(seed_lo ^ _mix(seed_hi ^ _mix(tl.load(counters_ptr + row).to(tl.uint32))))
    if HAS_CUT:
        cut_value = tl.load(cut_value_ptr + row)
        cut_id = tl.load(cut_id_ptr + row)
    else:
        cut_value = float("-inf")
        cut_id = vocab_size
    first = split * split_len
    end = tl.minimum(first + split_len, vocab_size)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = first + lanes
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    for start in range(first, end, BLOCK):
        ids = start + lanes
        x = tl.load(row_ptr + ids, mask=ids < end, other=float("-inf")).to(tl.float32)
        scaled = tl.div_rn(x, divisor)
        kept = (scaled > cut_value) | ((scaled == cut_value) & (ids <= cut_id))
        drawn = tl.where(kept, scaled + _gumbel(key, ids), float("-inf"))
        score = tl.where(is_sampled, drawn, x)
        is_better = score > best
        best = tl.where(is_better, score, best)
        best_id = tl.where(is_better, ids, best_id)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_id, vocab_size), axis=0)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        tl.store(part_max_ptr + row * NUM_SPLITS + split, top)
        tl.store(part_id_ptr + row * NUM_SPLITS + split, token)


def _combine_body(part_max_ptr, part_id_ptr, out_ptr, vocab_size, NUM_SPLITS: tl.constexpr,
                  SPLITS_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_BLOCK)
    mask = splits < NUM_SPLITS
    top = tl.load(part_max_ptr + row * NUM_SPLITS + splits, mask=mask, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * NUM_SPLITS + splits, mask=mask, other=0)
    best = tl.max(top, axis=0)
    token = tl.min(tl.where(mask & (top == best), ids, vocab_size), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))
