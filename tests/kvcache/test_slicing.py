import pytest

from kvcache import KVSliceError, plan_slice, stale_end
from tests.kvcache.helpers import build_pair, check_received, execute


def slice_ordinals(P, W, B, D, E, group):
    _, ctx, gen = build_pair(P, W, B, D, E)
    window = W if group == "sliding" else None
    plan = plan_slice(ctx.get_block_ordinals("req", group), gen.get_block_ordinals("req", group), P, window, B)
    return [ordinal for ordinal, _, _ in plan], ctx, gen, plan


def test_worked_example_design_md():
    """B=8, W=16, P=30, D=3, E=2: generation table [-1, g1, g2, g3, g4]; slice 1, 2, 3."""
    ordinals, ctx, gen, plan = slice_ordinals(30, 16, 8, 3, 2, "sliding")
    assert ordinals == [1, 2, 3]
    dst = gen.get_block_ordinals("req", "sliding")
    src = ctx.get_block_ordinals("req", "sliding")
    assert len(dst) == 5 and dst[0] == -1 and all(p >= 0 for p in dst[1:])
    assert plan == [(i, src[i], dst[i]) for i in (1, 2, 3)]
    execute(plan, ctx, gen, "sliding")
    assert check_received(gen, "req", "sliding", 30, 16) == []


def test_prompt_on_block_boundary():
    ordinals, *_ = slice_ordinals(32, 16, 8, 3, 2, "sliding")
    assert ordinals == [2, 3]


def test_gpt_oss_geometry():
    assert slice_ordinals(1022, 128, 32, 3, 2, "sliding")[0] == list(range(27, 32))
    assert slice_ordinals(1022, 128, 32, 3, 2, "full")[0] == list(range(0, 32))


def test_stale_end_formula():
    assert stale_end(30, 16, 8) == 1
    assert stale_end(30, None, 8) == 0
    assert stale_end(5, 16, 8) == 0
    assert stale_end(1022, 128, 32) == 27


def test_unbound_destination_inside_slice_is_skipped_and_neighbours_keep_positions():
    P, W, B = 30, 16, 8
    _, ctx, gen = build_pair(P, W, B, 3, 2)
    src = ctx.get_block_ordinals("req", "sliding")
    dst = gen.get_block_ordinals("req", "sliding")
    have = dst[2]
    dst[2] = -1  # the receiver already holds block 2
    plan = plan_slice(src, dst, P, W, B)
    assert plan == [(1, src[1], dst[1]), (3, src[3], dst[3])]
    execute(plan, ctx, gen, "sliding")
    problems = check_received(gen, "req", "sliding", P, W)
    # Only the skipped block differs; blocks 1 and 3 hold their own tokens.
    assert problems and all(p.startswith("ordinal 2 ") for p in problems)
    assert have >= 0


def test_unbound_source_inside_slice_fails_before_planning():
    src = [0, 1, -1, 3]
    with pytest.raises(KVSliceError, match=r"ordinals \[2\]"):
        plan_slice(src, [9, 8, 7, 6, 5], 30, 16, 8)


def test_unbound_source_outside_slice_is_fine():
    assert plan_slice([-1, 1, 2, 3], [-1, 5, 6, 7, 8], 30, 16, 8) == [(1, 1, 5), (2, 2, 6), (3, 3, 7)]


@pytest.mark.parametrize("src,dst", [([0, 1, 2], [0, 1, 2, 3]), ([0, 1, 2, 3], [0, 1, 2])])
def test_short_tables_raise(src, dst):
    with pytest.raises(KVSliceError, match="table has 3 entries"):
        plan_slice(src, dst, 30, 16, 8)
