"""Property sweep: a request admitted on a prefix-cache hit reads, in every group and
within every window, exactly the keys of its own positions and tokens; and a hit rule
that counts matching blocks instead of checking the window's ordinals is caught.

Each case runs request A (prompt, then decode with draft scratch), frees it, optionally
runs C (another user sharing A's head, which makes that head recently used), runs a
filler F that evicts the least recently used cached pages of the small window pool,
then admits B, which shares ``shared`` tokens of A (all of them: a multi-turn
follow-up; or diverging mid-block) and decodes a few tokens.
"""

import math
import random
from dataclasses import dataclass

from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager, block_hashes, stale_end
from tests.kvcache.helpers import make_spec
from tests.kvcache.prefix_helpers import fill_storage, reference_hit, run_request, write_tokens

SETS_PREFIX_CACHING = True


@dataclass(frozen=True)
class Case:
    B: int
    W: int
    P_A: int
    gen_A: int
    shared: int
    tail: int
    gen_B: int
    touch: int | None
    fill: int
    D: int
    E: int
    seed: int


@st.composite
def cases(draw) -> Case:
    B, W = draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(2, 40))
    P_A, gen_A = draw(st.integers(1, 60)), draw(st.integers(0, 12))
    multi_turn = draw(st.booleans())
    shared = P_A + gen_A if multi_turn else draw(st.integers(0, P_A + gen_A))
    tail = draw(st.integers(1 if multi_turn or shared == 0 else 0, 24))
    touch = draw(st.none() | st.integers(1, P_A + gen_A))
    return Case(B, W, P_A, gen_A, shared, tail, draw(st.integers(0, 3)), touch, draw(st.integers(0, 40)),
                draw(st.integers(0, 3)), draw(st.integers(0, 2)), draw(st.integers(0, 2**16)))


def diverging(rng: random.Random, base: list[int], start: int, length: int) -> list[int]:
    """``length`` new tokens after ``base[:start]``; the first differs from ``base[start]``."""
    tail = [rng.randrange(50) for _ in range(length)]
    if tail and start < len(base) and tail[0] == base[start]:
        tail[0] = (tail[0] + 1) % 50
    return base[:start] + tail


def run_case(c: Case, hit_rule=None) -> tuple[int, int, list[str]]:
    """B's hit, the hit from positions alone, and every misplaced key any query read."""
    rng = random.Random(c.seed)
    tokens_a = [rng.randrange(50) for _ in range(c.P_A + c.gen_A)]
    tokens_b = diverging(rng, tokens_a, c.shared, c.tail + c.gen_B)
    tokens_c = diverging(rng, tokens_a, c.touch, 3) if c.touch else []
    pages = [math.ceil((len(t) + c.D + c.E) / c.B) for t in (tokens_a, tokens_b, tokens_c)]
    window_pages = max(pages) + 1                        # small: the filler evicts from it
    fill = min(c.fill, window_pages)
    manager = KVCacheManager(make_spec(c.W, c.B), {"full": sum(pages) + fill + 1, "sliding": window_pages},
                             enable_prefix_caching=True)
    fill_storage(manager)
    _, problems = run_request(manager, "A", tokens_a, c.P_A, draft_len=c.D, num_extra=c.E)
    manager.free("A")
    if tokens_c:
        problems += run_request(manager, "C", tokens_c, len(tokens_c), draft_len=c.D, num_extra=c.E)[1]
        manager.free("C")
    manager.allocate("F", fill * c.B)
    write_tokens(manager, "F", [], 0, fill * c.B, junk=True)  # F computes its own KV over what it evicted
    manager.free("F")
    P_B = c.shared + c.tail
    expected = reference_hit(manager, block_hashes(tokens_b[:P_B], c.B), P_B)
    h, more = run_request(manager, "B", tokens_b, P_B, draft_len=c.D, num_extra=c.E, hit_rule=hit_rule)
    manager.free("B")
    manager.check_integrity()
    assert manager.num_free_pages() == manager.num_total_pages()
    return h, expected, problems + more


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_key_a_query_reads_holds_its_position_and_token(case):
    h, expected, problems = run_case(case)
    assert problems == []
    assert h == expected, f"hit {h}, positions allow {expected}"
    assert h % case.B == 0 and h <= case.shared + case.tail - 1


def count_based_hit(manager: KVCacheManager, hashes: list[bytes], P: int) -> int:
    """The defect, kept as a reference: a window group "covers" a hit of k blocks when it holds
    as many matching blocks as the window spans, wherever they sit (a full group still needs all)."""
    B, groups = manager.spec.tokens_per_block, manager.spec.groups
    for k in range(min(len(hashes), (P - 1) // B), 0, -1):
        matching = {g.name: sum(h in manager.cached_block_hashes(g.name) for h in hashes[:k]) for g in groups}
        if all(matching[g.name] >= k - stale_end(k * B, g.window, B) for g in groups):
            return k * B
    return 0


def test_count_based_hit_rule_is_caught_by_the_sweep():
    caught = find(cases(), lambda c: bool(run_case(c, count_based_hit)[2]),
                  settings=settings(max_examples=3000, database=None, deadline=None, derandomize=True,
                                    phases=[Phase.generate]))
    h, expected, problems = run_case(caught, count_based_hit)
    assert h > expected and any("sliding" in p for p in problems), (caught, h, expected, problems)
