import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache import get_kv_capacity_tokens, num_blocks


def test_worked_example_capacity():
    assert get_kv_capacity_tokens(30, 3, 2) == 35
    assert num_blocks(35, 8) == 5
    assert get_kv_capacity_tokens(30, 3, 2, include_drafts=False) == 32


@given(st.integers(0, 10_000), st.integers(0, 16), st.integers(0, 8), st.booleans())
def test_capacity_is_the_sum_of_its_terms(P, D, E, include_drafts):
    got = get_kv_capacity_tokens(P, D, E, include_drafts=include_drafts)
    assert got == P + (D if include_drafts else 0) + E


@pytest.mark.parametrize("args", [(-1, 0, 0), (5, -1, 0), (5, 0, -2)])
def test_negative_terms_raise(args):
    with pytest.raises(ValueError):
        get_kv_capacity_tokens(*args)
