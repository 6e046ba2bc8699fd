"""bench.defect_slice on real Gemma 3 weights: the ordinal slice gives the aggregated tokens; the
count-based selection (the defect's test double) gives them too where no draft block crossed a boundary,
and other tokens where one did."""

from __future__ import annotations

import pytest
import torch

from bench.defect_slice import MODEL, count_based_plan, is_loop, measure
from engine import EngineConfig
from engine.worker_model import WorkerModel


@pytest.fixture(scope="module")
def gemma() -> WorkerModel:
    torch.set_num_threads(2)
    return WorkerModel.load(EngineConfig(model=MODEL, device="cpu"))


def test_the_count_based_selection_is_one_block_late_only_when_the_table_has_a_surplus():
    # the design's worked example: B=8, W=16, P=30, D=3: generation table [-1, g1, g2, g3, g4]
    assert count_based_plan([0, 1, 2, 3], [-1, 11, 12, 13, 14], 30, 16, 8) == [(1, 1, 12), (2, 2, 13), (3, 3, 14)]
    assert count_based_plan([0, 1, 2, 3], [-1, 11, 12, 13], 30, 16, 8) == [(1, 1, 11), (2, 2, 12), (3, 3, 13)]


def test_is_loop():
    assert is_loop([5, 6] * 12) and not is_loop(list(range(24))) and not is_loop([5, 6] * 3)


def test_ordinal_equals_aggregated_and_the_surplus_breaks_count_based(gemma):
    # 300 tokens: 300 % 16 = 12, 12 + 3 drafts stay in the block; 366 % 16 = 14: the drafts cross it
    rows = measure([300, 366], max_tokens=24, model=gemma)["rows"]
    assert [r["ordinal_equal"] for r in rows] == [True, True]
    assert [r["surplus_slices"] for r in rows] == [0, 2]  # both groups, sliding and full
    assert [r["count_based_equal"] for r in rows] == [True, False]
