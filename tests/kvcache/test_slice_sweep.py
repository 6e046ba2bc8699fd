"""Property sweep: every planned pair moves the right tokens to the right place,
and the old count-based selection is caught on the cases where it goes wrong."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.defect_slice import count_based_plan  # the defect's test double, kept in bench/ only
from kvcache import KVCacheManager, plan_slice
from tests.kvcache.helpers import (
    UNWRITTEN,
    build_pair,
    check_received,
    execute,
    make_spec,
    tag_prompt,
)

geometry = st.tuples(
    st.sampled_from([1, 2, 4, 8, 16]),                # B
    st.integers(1, 160),                               # P
    st.one_of(st.none(), st.integers(2, 96)),          # W
    st.integers(0, 5),                                 # D
    st.integers(0, 3),                                 # E
)


def drafts_cross_a_block(P, B, D, E):
    return math.ceil((P + D + E) / B) > math.ceil((P + E) / B)


@settings(max_examples=250, deadline=None)
@given(geometry)
def test_windowed_slice_lands_every_token_in_its_place(g):
    B, P, W, D, E = g
    spec, ctx, gen = build_pair(P, W, B, D, E)
    for group in spec.groups:
        plan = plan_slice(
            ctx.get_block_ordinals("req", group.name), gen.get_block_ordinals("req", group.name),
            P, group.window, B,
        )
        execute(plan, ctx, gen, group.name)
        assert check_received(gen, "req", group.name, P, group.window) == []
    ctx.check_integrity()
    gen.check_integrity()


@settings(max_examples=200, deadline=None)
@given(geometry.filter(lambda g: drafts_cross_a_block(g[1], g[0], g[3], g[4])))
def test_count_based_selection_is_rejected_when_drafts_cross_a_block(g):
    B, P, W, D, E = g
    spec, ctx, gen = build_pair(P, W, B, D, E)
    caught = []
    for group in spec.groups:
        src = ctx.get_block_ordinals("req", group.name)
        dst = gen.get_block_ordinals("req", group.name)
        execute(count_based_plan(src, dst, P, group.window, B), ctx, gen, group.name)
        caught.append(bool(check_received(gen, "req", group.name, P, group.window)))
    # The full group always needs block 0 .. T-1: a shifted selection misses block 0.
    assert caught[0], f"count-based selection passed the full group for {g}"
    assert all(caught), f"count-based selection passed a group for {g}"


@settings(max_examples=200, deadline=None)
@given(geometry, st.integers(1, 4))
def test_a_multi_token_handoff_slices_at_num_kv_tokens(g, k):
    """A context side that decoded k - 1 tokens past the prompt before handing over (releasing
    stale window pages after each step, as the engine does) still holds every block of the slice
    at N = P + k - 1, and that slice lands every position a query at N reads in its place."""
    B, P, W, D, E = g
    N = P + k - 1
    spec = make_spec(W, B)
    pages = math.ceil((N + D + E) / B) + 4
    ctx, gen = KVCacheManager(spec, pages), KVCacheManager(spec, pages)
    ctx.allocate("req", P, num_extra_kv_tokens=E, include_drafts=False)
    for computed in range(P, N):  # the quiet steps: KV of `computed` tokens written, one more appended
        ctx.release_stale("req", computed)
        ctx.append("req", 1)
    for tensor in [*ctx.storage.tensors.values(), *gen.storage.tensors.values()]:
        tensor.fill_(UNWRITTEN)
    tag_prompt(ctx, "req", N)
    gen.allocate("req", N, num_computed_tokens=N, draft_len=D, num_extra_kv_tokens=E)
    for group in spec.groups:
        plan = plan_slice(ctx.get_block_ordinals("req", group.name), gen.get_block_ordinals("req", group.name),
                          N, group.window, B)
        execute(plan, ctx, gen, group.name)
        assert check_received(gen, "req", group.name, N, group.window) == []
    ctx.check_integrity()
    gen.check_integrity()
