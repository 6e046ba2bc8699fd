"""engine.gpu.step_buffers on the CPU: bucket choice, what a step stages (rows, slots, padding), refresh
between steps of different sizes, and the host check that every ordinal a token reads is bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape, bucket_sizes, choose_bucket

B = 4


def make_buffers(max_num_seqs: int = 4, max_tokens: int = 8, width: int = 6) -> StaticStepBuffers:
    shape = StepShape(max_num_seqs=max_num_seqs, max_tokens=max_tokens, table_width=width, tokens_per_block=B,
                      windows={"full": None, "sliding": 8})
    return StaticStepBuffers(shape, "cpu")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.data())
def test_bucket_is_the_smallest_size_that_holds_the_step(max_tokens, data):
    sizes = bucket_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    assert sizes[0] == 1 and [s for s in sizes if s <= 8] == [s for s in (1, 2, 4, 8) if s < max_tokens] + (
        [max_tokens] if max_tokens <= 8 else [])
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))
    num_tokens = data.draw(st.integers(1, max_tokens))
    bucket = choose_bucket(num_tokens, sizes)
    assert bucket >= num_tokens and bucket in sizes
    assert all(size < num_tokens for size in sizes if size < bucket)
    with pytest.raises(ValueError):
        choose_bucket(max_tokens + 1, sizes)


def test_small_bucket_sizes():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert bucket_sizes(3) == [1, 2, 3]


def request(name: str, tokens: list[int], first: int, full: list[int], sliding: list[int], **kwargs) -> StepRequest:
    return StepRequest(name, tokens, first, {"full": full, "sliding": sliding}, **kwargs)


def test_a_step_stages_rows_positions_and_slots_and_pads_the_rest():
    buffers = make_buffers()
    # r0: one token at position 11 (block 2, slot 3; window 8 reads blocks 1, 2)
    # r1: 1 + 2 drafts at positions 3..5 (blocks 0, 1)
    size = buffers.fill([request("r0", [11], 11, [5, 6, 7], [-1, 8, 9], temperature=0.5, seed=2**40 + 3),
                         request("r1", [21, 22, 23], 3, [1, 2], [3, 4], first_output=4)])
    views = buffers.host_views
    assert size == 4 and buffers.num_tokens == 4
    assert views["input_ids"].tolist()[:5] == [11, 21, 22, 23, 0]
    assert views["positions"].tolist()[:5] == [11, 3, 4, 5, -1]
    assert views["table_rows"].tolist()[:5] == [0, 1, 1, 1, -1]
    assert views["token_offsets"].tolist()[:5] == [0, 0, 1, 2, -1]
    assert views["counters"].tolist()[:4] == [0, 4, 5, 6]
    assert views["slots", "full"].tolist()[:5] == [7 * B + 3, 1 * B + 3, 2 * B + 0, 2 * B + 1, -1]
    assert views["slots", "sliding"].tolist()[:5] == [9 * B + 3, 3 * B + 3, 4 * B + 0, 4 * B + 1, -1]
    assert views["temperature"][:2].view(np.float32).tolist() == [0.5, 0.0]
    seed = int(views["seed_lo"][0]) | int(views["seed_hi"][0]) << 31
    assert seed == 2**40 + 3
    buffers.upload()
    assert torch.equal(buffers.flat, buffers.host)
    tables = buffers.views["tables", "sliding"]  # the device table the kernels read
    assert tables[:3].tolist() == [[-1, 8, 9, -1, -1, -1], [3, 4, -1, -1, -1, -1], [-1] * 6]


def test_refill_with_fewer_requests_leaves_nothing_of_the_larger_step():
    reused, fresh = make_buffers(), make_buffers()
    reused.fill([request("a", [1, 2, 3], 4, [1, 2], [1, 2]), request("b", [4], 0, [3], [3]),
                 request("c", [5, 6], 5, [4, 5], [4, 5])])
    small = [request("d", [7], 2, [6], [6])]
    reused.upload()  # the larger step's tables reach the device; the smaller one's must reset them
    assert reused.fill(small) == fresh.fill(small) == 1
    reused.upload()
    fresh.upload()
    assert torch.equal(read_by_kernels(reused), read_by_kernels(fresh))


def read_by_kernels(buffers: StaticStepBuffers) -> torch.Tensor:
    """Every value a step's kernels read: the token fields and slots, then each group's whole device table
    (the staging area past them is scratch for the next upload)."""
    tables = [buffers.views["tables", group].flatten() for group in buffers.groups]
    return torch.cat([buffers.flat[: buffers.token_fields_end], *tables])


def test_an_unbound_ordinal_in_the_window_raises_naming_request_and_ordinal():
    buffers = make_buffers()
    # window 8 at position 9: reads positions 2..9, ordinals 0..2; ordinal 0 released -> refused
    with pytest.raises(ValueError, match=r"request 'late'.*'sliding'.*ordinal 0"):
        buffers.fill([request("late", [1], 9, [1, 2, 3], [-1, 2, 3])])
    # at position 11 the window reads positions 4..11: ordinals 1, 2 only, so a released ordinal 0 is fine
    assert buffers.fill([request("ok", [1], 11, [1, 2, 3], [-1, 2, 3])]) == 1
    with pytest.raises(ValueError, match=r"request 'short'.*'full'.*ordinal 2"):
        buffers.fill([request("short", [1], 9, [1, 2], [1, 2, 3])])  # the write's own block missing
    with pytest.raises(ValueError, match=r"'full'.*ordinal 1"):
        buffers.fill([request("hole", [1, 2], 7, [1, -1, 3], [1, 2, 3])])  # full attention reads every ordinal


def test_too_many_requests_or_tokens_raise():
    buffers = make_buffers(max_num_seqs=2, max_tokens=4)
    with pytest.raises(ValueError, match="3 requests"):
        buffers.fill([request(str(i), [1], 0, [1], [1]) for i in range(3)])
    with pytest.raises(ValueError, match="pass the buffers"):
        buffers.fill([request("a", [1, 2, 3], 0, [1], [1]), request("b", [1, 2], 0, [2], [2])])


def staged_one_by_one(requests: list[StepRequest], width: int, max_tokens: int) -> dict:
    """What a step must stage, written token by token and ordinal by ordinal (the definition the
    whole-array staging must meet)."""
    want = {name: [pad] * max_tokens for name, pad in (("input_ids", 0), ("sampled_from", -1), ("positions", -1),
                                                         ("table_rows", -1), ("token_offsets", -1), ("counters", 0),
                                                         ("top_k", 0), ("slots_full", -1), ("slots_sliding", -1))}
    want["temperature"], want["top_p"] = [0.0] * max_tokens, [1.0] * max_tokens
    want["seed"] = [0] * max_tokens
    token = 0
    for row, r in enumerate(requests):
        for offset, token_id in enumerate(r.token_ids):
            position = r.first_position + offset
            for name, value in (("input_ids", token_id), ("positions", position), ("table_rows", row),
                                ("token_offsets", offset), ("counters", r.first_output + offset), ("top_k", r.top_k),
                                ("temperature", r.temperature), ("top_p", r.top_p),
                                ("seed", r.seed % 2**62),  # two 31-bit halves; the host's draws reduce alike
                                ("sampled_from", r.sampled_from if offset == 0 else -1)):
                want[name][token] = value
            for group in ("full", "sliding"):
                want[f"slots_{group}"][token] = r.tables[group][position // B] * B + position % B
            token += 1
    want["tables"] = {g: [r.tables[g] + [-1] * (width - len(r.tables[g])) for r in requests]
                      for g in ("full", "sliding")}
    return want


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_whole_array_staging_equals_staging_token_by_token(data):
    width, max_tokens = 6, 8
    buffers = make_buffers(max_tokens=max_tokens, width=width)
    requests, budget = [], max_tokens
    for i in range(data.draw(st.integers(1, 4))):
        if budget == 0:
            break
        num_new = data.draw(st.integers(1, min(3, budget)))
        budget -= num_new
        first = data.draw(st.integers(0, width * B - num_new))
        last = (first + num_new - 1) // B
        full = data.draw(st.lists(st.integers(0, 99), min_size=last + 1, max_size=width))
        window_start = max(0, first - 8 + 1) // B  # sliding window 8: ordinals below it may be released
        sliding = [-1 if k < window_start and data.draw(st.booleans()) else p
                   for k, p in enumerate(data.draw(st.lists(st.integers(0, 99), min_size=last + 1, max_size=width)))]
        requests.append(StepRequest(
            f"r{i}", data.draw(st.lists(st.integers(0, 300), min_size=num_new, max_size=num_new)), first,
            {"full": full, "sliding": sliding}, temperature=data.draw(st.sampled_from([0.0, 0.7])),
            top_p=data.draw(st.sampled_from([1.0, 0.9])), top_k=data.draw(st.integers(0, 50)),
            seed=data.draw(st.integers(0, 2**63 - 1)), first_output=data.draw(st.integers(0, 40)),
            sampled_from=data.draw(st.integers(-1, 7))))
    buffers.fill(requests)
    want = staged_one_by_one(requests, width, max_tokens)
    views = buffers.host_views
    for name in ("input_ids", "sampled_from", "positions", "table_rows", "token_offsets", "counters", "top_k"):
        assert views[name].tolist() == want[name], name
    assert views["temperature"].view(np.float32).tolist() == pytest.approx(want["temperature"])
    assert views["top_p"].view(np.float32).tolist() == pytest.approx(want["top_p"])
    seeds = [int(lo) | int(hi) << 31 for lo, hi in zip(views["seed_lo"], views["seed_hi"])]
    assert seeds == want["seed"]
    for group in ("full", "sliding"):
        assert views["slots", group].tolist() == want[f"slots_{group}"]
    buffers.upload()
    for group in ("full", "sliding"):
        tables = buffers.views["tables", group]  # on the device, what the kernels read
        assert tables[: len(requests)].tolist() == want["tables"][group]
        assert (tables[len(requests):] == -1).all()
