"""engine.gpu.triton_sampling's one-pass draw against engine.gpu.sampling's torch ops, token for token and
noise bit for bit; the host's counter draws against the kernel's; and the draws' distribution against
softmax(logits / T). Without a GPU (CI) the kernel runs under Triton's interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1); on a GPU machine compiled, on CUDA tensors, against torch on CUDA."""

from __future__ import annotations

import json

import torch
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu.sampling import (
    SamplingRows,
    gumbel_noise,
    is_kept,
    log_f32,
    sample_tokens,
    sampling_rows,
    top_cut,
    uniform_noise,
)
from engine.gpu.triton_build import is_interpreted, jitted
from engine.gpu.triton_sampling import BLOCK, _gumbel, _log, triton_sample_tokens
from engine.params import SamplingParams
from engine.sampler import Sampler, sampling_probs

DEVICE = "cpu" if is_interpreted() else "cuda"
U_IS_ONE = (0, 433, 20393)  # (seed, counter, token): its 24 bits are 2**24 - 1, whose + 0.5 rounds u up to 1.0


def _draw(logits, rows: SamplingRows, use_kernel: bool) -> list[int]:
    rows = SamplingRows(*(t.to(logits.device) for t in rows))
    is_sampled = rows.temperature > 0
    is_filtered = bool((is_sampled & ((rows.top_k > 0) | (rows.top_p < 1))).any())
    return sample_tokens(logits, rows, is_greedy=not bool(is_sampled.any()), is_filtered=is_filtered,
                         use_kernel=use_kernel).tolist()


def _row_values(draw_row, num_rows):
    """Per row: temperature (0 = greedy), top_k, top_p, seed, counter."""
    rows = [draw_row() for _ in range(num_rows)]
    return [list(column) for column in zip(*rows)]


ROW = st.tuples(st.sampled_from([0.0, 0.0, 0.3, 1.0, 1.7]), st.sampled_from([0, 0, 1, 3, 40]),
                st.sampled_from([1.0, 1.0, 0.5, 0.9]), st.integers(0, 2**62), st.integers(0, 2**31 - 1))


@settings(max_examples=25, deadline=None)
@given(num_rows=st.integers(1, 8), vocab=st.sampled_from([1, 2, 7, 100, 1000, BLOCK, BLOCK + 1, 2 * BLOCK + 37]),
       rows=st.data(), ties=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       data_seed=st.integers(0, 2**31))
def test_kernel_draws_the_torch_ops_ids(num_rows, vocab, rows, ties, dtype, data_seed):
    """Mixed greedy and sampled rows, filtered or not, in one step; ``ties``: logits on a coarse grid, so
    exact ties everywhere (greedy: the lowest id; sampled: the noise decides, the same bits on both)."""
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(data_seed)) * 4
    if ties:
        logits = (logits / 2).round() * 2
    logits = logits.to(dtype)
    values = _row_values(lambda: rows.draw(ROW), num_rows)
    cpu_rows = sampling_rows(*values, torch.device("cpu"))
    on_device = logits.to(DEVICE)
    assert _draw(on_device, cpu_rows, use_kernel=True) == _draw(on_device, cpu_rows, use_kernel=False)


@settings(max_examples=10, deadline=None)
@given(num_rows=st.integers(1, 4), vocab=st.sampled_from([BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 5]),
       num_splits=st.integers(2, 5), rows=st.data(), dead_row=st.booleans(), data_seed=st.integers(0, 2**31))
def test_a_row_split_across_programs_draws_the_one_pass_ids(num_rows, vocab, num_splits, rows, dead_row, data_seed):
    """Splits of the vocabulary, combined (max, then the lowest id holding it), on tied logits; a row all
    -inf (a grammar that masks everything) draws token 0 as torch's argmax does."""
    logits = (torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(data_seed)) * 2).round()
    if dead_row:
        logits[0] = float("-inf")
    values = _row_values(lambda: rows.draw(ROW), num_rows)
    device_rows = SamplingRows(*(t.to(DEVICE) for t in sampling_rows(*values, torch.device("cpu"))))
    on_device = logits.to(DEVICE)
    is_sampled = device_rows.temperature > 0
    cut = top_cut(on_device / torch.where(is_sampled, device_rows.temperature, 1.0)[:, None], device_rows.top_k,
                  device_rows.top_p)
    for row_cut in (None, cut):
        split = triton_sample_tokens(on_device, device_rows, row_cut, num_splits=num_splits).tolist()
        assert split == triton_sample_tokens(on_device, device_rows, row_cut, num_splits=1).tolist()
    assert split == _draw(on_device, device_rows, use_kernel=False)
    if dead_row:
        assert split[0] == 0


def _noise_body(out_ptr, key, vocab_size, BLOCK: tl.constexpr):
    ids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + ids, _gumbel(key.to(tl.uint32), ids), mask=ids < vocab_size)


def _log_body(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, _log(tl.load(x_ptr + offsets, mask=mask, other=1.0)), mask=mask)


def _row_key(seed: int, counter: int) -> int:
    from engine.gpu.sampling import _mix

    seed_lo, seed_hi = (torch.tensor([part]) for part in (seed & (2**31 - 1), (seed >> 31) & (2**31 - 1)))
    return int(_mix(seed_lo ^ _mix(seed_hi ^ _mix(torch.tensor([counter])))))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**62), counter=st.integers(0, 2**31 - 1))
def test_the_kernels_noise_is_torchs_bit_for_bit(seed, counter):
    vocab = 3000
    out = torch.empty(vocab, device=DEVICE)
    jitted(_noise_body)[(triton_cdiv(vocab, 1024),)](out, _row_key(seed, counter), vocab, BLOCK=1024,
                                                     enable_fp_fusion=False)
    rows = sampling_rows([1.0], [0], [1.0], [seed], [counter], torch.device(DEVICE))
    assert torch.equal(out, gumbel_noise(rows.seed_lo, rows.seed_hi, rows.counters, vocab)[0])


def test_log_f32_is_the_kernels_log_and_close_to_log():
    """Random bit patterns over every positive normal float32, and the ends of the noise's range."""
    bits = torch.randint(0x00800000, 0x7F800000, (20_000,), generator=torch.Generator().manual_seed(1),
                         dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.tensor([0.5 / 2**24, 1 - 2**-24, 1.0, 17.33, 2.0 ** -126])])
    out = torch.empty_like(x).to(DEVICE)
    jitted(_log_body)[(triton_cdiv(len(x), 1024),)](x.to(DEVICE), out, len(x), BLOCK=1024, enable_fp_fusion=False)
    assert torch.equal(out.cpu(), log_f32(x))
    exact = x.double().log()
    assert ((log_f32(x).double() - exact).abs() <= 2e-7 * exact.abs().clamp_min(1.0)).all()


def test_a_u_of_one_is_taken_as_the_float_below_one_on_both_paths():
    seed, counter, token = U_IS_ONE
    rows = sampling_rows([1.0], [0], [1.0], [seed], [counter], torch.device("cpu"))
    assert float(uniform_noise(rows.seed_lo, rows.seed_hi, rows.counters, token + 1)[0, token]) == 1.0
    noise = gumbel_noise(rows.seed_lo, rows.seed_hi, rows.counters, token + 1)[0]
    assert torch.isfinite(noise).all() and int(noise.argmax()) == token  # -log(-log(1 - 2**-24)) = 16.6
    flat = torch.zeros(1, token + 1, device=DEVICE)
    assert _draw(flat, rows, use_kernel=True) == _draw(flat, rows, use_kernel=False) == [token]


@settings(max_examples=15, deadline=None)
@given(num_rows=st.integers(1, 6), vocab=st.integers(2, 300), seed=st.integers(0, 2**62), top_k=st.sampled_from([0, 5]),
       top_p=st.sampled_from([1.0, 0.8]), greedy_row=st.integers(0, 5))
def test_the_hosts_counter_draws_are_the_kernels(num_rows, vocab, seed, top_k, top_p, greedy_row):
    """Sampler(counter_draws=True) on CPU logits (the torch ops) against sample_tokens' kernel on DEVICE,
    the same rows keyed by (seed, output index); greedy rows among them."""
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed % 2**31)) * 3
    params = [SamplingParams(temperature=0.0 if i == greedy_row else 0.6 + 0.2 * i, top_k=top_k, top_p=top_p,
                             seed=seed + i) for i in range(num_rows)]
    keys = [(p.seed, 7 * i + 2) for i, p in enumerate(params)]
    host = Sampler(counter_draws=True).sample(logits, params, [None] * num_rows, keys).token_ids
    rows = sampling_rows([0.0 if p.is_greedy else p.temperature for p in params], [top_k] * num_rows,
                         [top_p] * num_rows, *zip(*keys), torch.device("cpu"))
    assert host == _draw(logits.to(DEVICE), rows, use_kernel=True)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 60), top_k=st.integers(0, 12), top_p=st.floats(0.05, 1.0), data_seed=st.integers(0, 2**31))
def test_top_cut_keeps_exactly_the_hosts_allowed_set(vocab, top_k, top_p, data_seed):
    """The (value, id) cut names the tokens engine.sampler's sort and softmax give a probability, ties
    included (logits on a grid)."""
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(data_seed)) * 2).round()
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * 4
    cut = top_cut(logits, torch.full((4,), top_k), torch.full((4,), top_p))
    assert torch.equal(is_kept(logits, cut), sampling_probs(logits, params) > 0)


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
CHI2_5DF_P1E4 = 25.74  # chi-square with 5 degrees of freedom, upper 1e-4 point (tables)


def _chi_square(ids: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(ids), minlength=len(probs)).double()
    expected = probs.double() * len(ids)
    return float(((counts - expected) ** 2 / expected).sum())


def _draws(num: int, temperature: float, use_kernel: bool, top_k: int = 0) -> list[int]:
    counters = list(range(num))
    seeds = [11 + c % 3 for c in counters]
    rows = sampling_rows([temperature] * num, [top_k] * num, [1.0] * num, seeds, counters, torch.device("cpu"))
    return _draw(LOGITS.expand(num, -1).contiguous().to(DEVICE), rows, use_kernel)


def test_draws_follow_softmax_of_logits_over_temperature():
    """20,000 draws (3 seeds, consecutive output indices) of the torch ops: chi-square under the 1e-4
    point against softmax(logits / 0.8), far over it against softmax(logits) (so the check can fail);
    the kernel's first 60 are the same draws (the interpreter is too slow for thousands); top-k 3
    draws only its 3 tokens, in their renormalized proportions."""
    want = (LOGITS / 0.8).softmax(-1)
    ids = _draws(20_000, 0.8, use_kernel=False)
    assert _chi_square(ids, want) < CHI2_5DF_P1E4
    assert _chi_square(ids, LOGITS.softmax(-1)) > 10 * CHI2_5DF_P1E4
    assert _draws(60, 0.8, use_kernel=True) == ids[:60]
    top3 = _draws(6_000, 0.8, use_kernel=False, top_k=3)
    assert set(top3) == {0, 1, 2}
    kept = (LOGITS[:3] / 0.8).softmax(-1)
    counts = torch.bincount(torch.tensor(top3), minlength=3).double()
    assert float(((counts - kept * 6_000) ** 2 / (kept * 6_000)).sum()) < 18.4  # 2 degrees of freedom, 1e-4


def triton_cdiv(n: int, block: int) -> int:
    return -(-n // block)


def test_the_sampling_bench_runs_and_its_kernel_draws_the_torch_ops_ids(tmp_path):
    """bench.sampling_gpu (bench/gpu_check.sh times it on CUDA at 256 x 151,936 and 64 x 49,152) on a shape
    the interpreter runs quickly: every column measured, the kernel's ids checked, the JSON written; and its
    copy of the previous sampler still draws only allowed tokens under top-p."""
    from bench import sampling_gpu

    for top_p in ("1.0", "0.5"):
        [row] = sampling_gpu.main(["--device", DEVICE, "--shapes", "3x1500", "--repeats", "1", "--top-p", top_p,
                                   "--out", str(tmp_path)])
        assert row["ids_equal"] == "3/3"
        assert all(row[f"{name}_ms"] > 0 for name in ("previous", "torch", "kernel", "greedy"))
    assert json.loads((tmp_path / f"sampling_gpu_{DEVICE}_top_p_0.5.json").read_text())[0]["ids_equal"] == "3/3"
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3
    rows = sampling_rows([0.7] * 4, [0] * 4, [0.5] * 4, [1, 2, 3, 4], [0, 1, 2, 3], torch.device("cpu"))
    allowed = is_kept(logits / 0.7, top_cut(logits / 0.7, rows.top_k, rows.top_p))
    ids = sampling_gpu.previous_sample_tokens(logits, rows, is_filtered=True)
    assert all(bool(allowed[i, t]) for i, t in enumerate(ids.tolist()))
