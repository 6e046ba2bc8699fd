"""Staging only a step's live table region (engine.gpu.step_buffers) against the full staging it replaced.

Full staging wrote every row of every group's [max_num_seqs, table_width] table each step: the live rows'
ordinals, -1 everywhere else. After any sequence of steps (larger, smaller, wider, narrower) the device
tables must equal that, so the kernels read exactly what they read before and no ordinal of an earlier
step survives. The Triton kernel (its interpreter here) over the reused buffers gives the same output as
over a full staging of the same step, with every page the step does not name poisoned with NaN.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu.paged_attention import paged_decode_attention
from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape

B, WIDTH, MAX_SEQS, MAX_TOKENS, WINDOW, PAGES = 4, 6, 4, 8, 8, 64
WINDOWS = {"full": None, "sliding": WINDOW}


def draw_step(data) -> list[StepRequest]:
    """1..4 requests of 1..3 tokens each, every ordinal a token reads bound (a sliding row's ordinals
    below its window sometimes released, -1), tables 1..WIDTH long."""
    requests, budget = [], MAX_TOKENS
    for i in range(data.draw(st.integers(1, MAX_SEQS))):
        if budget == 0:
            break
        num_new = data.draw(st.integers(1, min(3, budget)))
        budget -= num_new
        first = data.draw(st.integers(0, WIDTH * B - num_new))
        last = (first + num_new - 1) // B
        window_start = max(0, first - WINDOW + 1) // B
        pages = st.lists(st.integers(0, PAGES - 1), min_size=last + 1, max_size=WIDTH)
        sliding = [-1 if k < window_start and data.draw(st.booleans()) else p
                   for k, p in enumerate(data.draw(pages))]
        tokens = data.draw(st.lists(st.integers(0, 99), min_size=num_new, max_size=num_new))
        requests.append(StepRequest(f"r{i}", tokens, first, {"full": data.draw(pages), "sliding": sliding}))
    return requests


def full_staging(requests: list[StepRequest], group: str) -> list[list[int]]:
    """What the full staging left in a group's table: each live row's ordinals, -1 everywhere else."""
    rows = [r.tables[group] + [-1] * (WIDTH - len(r.tables[group])) for r in requests]
    return rows + [[-1] * WIDTH] * (MAX_SEQS - len(requests))


def new_buffers() -> StaticStepBuffers:
    return StaticStepBuffers(StepShape(MAX_SEQS, MAX_TOKENS, WIDTH, B, WINDOWS), "cpu")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_device_tables_equal_the_full_staging_after_any_sequence_of_steps(data):
    buffers = new_buffers()
    for _ in range(data.draw(st.integers(2, 5))):
        requests = draw_step(data)
        buffers.fill(requests)
        buffers.upload()
        for group in WINDOWS:
            assert buffers.views["tables", group].tolist() == full_staging(requests, group), group


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_the_kernel_reads_the_same_keys_as_with_full_staging(data):
    """Step 1 (any), then step 2 on the reused buffers; the kernel's output over them equals its output over
    step 2's full staging, and is finite though every page step 2 does not name is NaN."""
    reused = new_buffers()
    reused.fill(draw_step(data))
    reused.upload()
    requests = draw_step(data)
    reused.fill(requests)
    reused.upload()
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    kv = torch.randn(PAGES, 1, 2, B, 1, 16, generator=generator)
    query = torch.randn(MAX_TOKENS, 2, 16, generator=generator)
    for group, window in WINDOWS.items():
        named = {p for r in requests for p in r.tables[group] if p >= 0}
        poisoned = kv.clone()
        poisoned[[p for p in range(PAGES) if p not in named]] = float("nan")
        full = torch.tensor(full_staging(requests, group), dtype=torch.int32)
        outputs = [paged_decode_attention(query, poisoned, 0, tables, reused.views["table_rows"].clamp(min=0),
                                          reused.views["positions"], window=window, scale=0.25)
                   for tables in (reused.views["tables", group], full)]
        live = reused.num_tokens
        assert torch.isfinite(outputs[0][:live]).all(), f"{group}: a key of an unnamed page was read"
        assert torch.equal(outputs[0], outputs[1])
