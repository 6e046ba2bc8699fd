"""Our paged models against ``transformers`` (eager) on the same tiny random checkpoints.

Sliding groups run with window 8; ordinals no query reads are unbound (-1) and
their pages filled with NaN, so any read of them shows up in the logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import engine.attention_buckets
from engine.attention_buckets import plan_buckets
from engine.layout import kv_cache_spec, layer_slots
from engine.models import MODEL_REGISTRY, build_model
from engine.models.decoder import fuse_projections
from engine.models.packed import pack_for_cpu
from tests.engine.helpers import CONFIGS, WINDOW, PagedKV, greedy, load_pair, relative_error

torch.set_num_threads(1)
ARCHS = list(CONFIGS)
PROMPT_LEN = 21  # > WINDOW, crosses several block boundaries for B = 4 and 8


@pytest.fixture(scope="module", params=[(arch, matmul) for arch in ARCHS for matmul in ("mkl", "onednn")],
                ids=lambda p: "-".join(p))
def pair(request):
    """``mkl``: the model as built; ``onednn``: as ``load_model`` prepares it, q/k/v fused and every
    weight packed (engine.models.packed; a real model packs only large ones)."""
    arch, matmul = request.param
    reference, ours, config = load_pair(arch)
    if matmul == "onednn":
        pack_for_cpu(fuse_projections(ours), min_elements=0)
    return arch, reference, ours, config


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("tokens_per_block", [4, 8])
def test_prompt_logits_match_in_one_prefill(pair, tokens_per_block):
    _, reference, ours, config = pair
    tokens = prompt(PROMPT_LEN)
    cache = PagedKV.for_config(config, tokens_per_block)
    logits = ours(cache.batch([(0, tokens, 0)]))
    assert relative_error(logits, reference_logits(reference, tokens)) < 1e-4


def test_prompt_logits_match_in_chunks(pair):
    _, reference, ours, config = pair
    tokens = prompt(PROMPT_LEN)
    cache = PagedKV.for_config(config, 4)
    chunks, start = [], 0
    for size in (5, 7, 9):  # each chunk releases the ordinals it no longer reads first
        chunks.append(ours(cache.batch([(0, tokens[start : start + size], start)])))
        start += size
    assert relative_error(torch.cat(chunks), reference_logits(reference, tokens)) < 1e-4


def test_greedy_tokens_match_generate(pair):
    _, reference, ours, config = pair
    tokens = prompt(11, seed=2)
    expected = reference.generate(torch.tensor([tokens]), max_new_tokens=32, do_sample=False)[0, len(tokens) :]
    assert len(expected) == 32
    assert greedy(ours, PagedKV.for_config(config, 4), tokens, 32) == expected.tolist()


@pytest.mark.parametrize("bucket_slack", [engine.attention_buckets._BUCKET_SLACK, 0])  # 0: one bucket per request
def test_batched_forward_equals_each_alone(pair, bucket_slack, monkeypatch):
    monkeypatch.setattr(engine.attention_buckets, "_BUCKET_SLACK", bucket_slack)
    _, _, ours, config = pair
    histories = [prompt(13, 3), prompt(16, 4), prompt(18, 5)]
    cached = [0, 10, 17]  # request 0: whole prompt; 1: a chunk after 10 cached tokens; 2: a decode step
    steps = [(r, history[c:], c) for r, (history, c) in enumerate(zip(histories, cached))]
    batched, alone = PagedKV.for_config(config, 4), []
    for (request, history), c, step in zip(enumerate(histories), cached, steps):
        single = PagedKV.for_config(config, 4)
        for cache in (single, batched):
            if c:
                ours(cache.batch([(request, history[:c], 0)]))
        alone.append(ours(single.batch([step])))
    together = ours(batched.batch(steps))
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_verify_step_then_rewind_overwrites_draft_kv(pair):
    _, reference, ours, config = pair
    tokens = prompt(PROMPT_LEN)
    cache = PagedKV.for_config(config, 4)
    ours(cache.batch([(0, tokens[:-2], 0)]))
    ours(cache.batch([(0, [tokens[-2], 5, 6, 7], PROMPT_LEN - 2)]))  # verify 1 + 3 drafts, all rejected
    logits = ours(cache.batch([(0, tokens[-1:], PROMPT_LEN - 1)]))  # rewound: rewrites the first draft's slot
    assert relative_error(logits, reference_logits(reference, tokens)[-1:]) < 1e-4


def test_logits_indices_select_rows(pair):
    _, _, ours, config = pair
    tokens = prompt(PROMPT_LEN)
    full = ours(PagedKV.for_config(config, 4).batch([(0, tokens, 0)]))
    picked = ours(PagedKV.for_config(config, 4).batch([(0, tokens, 0)], logits_indices=[3, 20]))
    assert picked.dtype == torch.float32
    torch.testing.assert_close(picked, full[[3, 20]])


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 600)), min_size=1, max_size=40))
def test_buckets_partition_the_requests(lens):
    query_lens = [q for q, _ in lens]
    key_lens = [q + k for q, k in lens]
    buckets = plan_buckets(query_lens, key_lens)
    assert sorted(r for b in buckets for r in b) == list(range(len(lens)))
    assert all(buckets)


def test_decode_steps_share_one_bucket():
    assert plan_buckets([1] * 32, [200 + 3 * r for r in range(32)]) == [list(range(32))]
    assert len(plan_buckets([1] * 31 + [2048], [500] * 31 + [2048])) == 2


def test_decodes_of_spread_lengths_split_into_buckets_of_similar_keys():
    key_lens = [64 + 16 * (r % 14) for r in range(32)]  # 64 .. 272 keys, as 32 chat decodes
    buckets = plan_buckets([1] * 32, key_lens)
    assert len(buckets) > 1
    bounds = [(min(key_lens[r] for r in b), max(key_lens[r] for r in b)) for b in buckets]
    assert all(high < low for (_, high), (low, _) in zip(bounds, bounds[1:]))  # shortest keys first, no overlap
    padded = sum(len(b) * max(key_lens[r] for r in b) for b in buckets)
    assert padded < 1.3 * sum(key_lens)


def test_unbound_ordinal_inside_window_is_an_error():
    _, ours, config = load_pair("mistral")
    cache = PagedKV.for_config(config, 4)
    tokens = prompt(12)
    ours(cache.batch([(0, tokens, 0)]))
    cache.tables[0]["sliding"][1] = -1  # positions 4..7: the query at 12 reads 5..12
    with pytest.raises(ValueError, match="unbound"):
        ours(cache.batch([(0, [1], 12)]))


@pytest.mark.parametrize("arch", ["gpt_oss", "llama"])
def test_bfloat16_runs_close_to_float32(arch):
    _, ours32, config = load_pair(arch)
    _, ours16, _ = load_pair(arch, dtype=torch.bfloat16)
    tokens = prompt(PROMPT_LEN)
    exact = ours32(PagedKV.for_config(config, 4).batch([(0, tokens, 0)]))
    approx = ours16(PagedKV.for_config(config, 4, torch.bfloat16).batch([(0, tokens, 0)]))
    assert approx.dtype == torch.float32 and torch.isfinite(approx).all()
    assert relative_error(approx, exact) < 5e-2


def test_kv_cache_spec_groups_layers_by_window():
    spec = kv_cache_spec(CONFIGS["gpt_oss"](), tokens_per_block=16)
    groups = [(g.name, g.layer_ids, g.window) for g in spec.groups]
    assert groups == [("sliding", (0, 2), WINDOW), ("full", (1, 3), None)]
    assert (spec.num_kv_heads, spec.head_dim) == (2, 16)
    slots = [(s.group, s.index) for s in layer_slots(CONFIGS["gpt_oss"]())]
    assert slots == [("sliding", 0), ("full", 0), ("sliding", 1), ("full", 1)]
    qwen = kv_cache_spec(CONFIGS["qwen2_sliding"](), 16)
    assert [(g.name, g.layer_ids) for g in qwen.groups] == [("full", (0, 1)), ("sliding", (2, 3))]
    assert [g.name for g in kv_cache_spec(CONFIGS["qwen2"](), 16).groups] == ["full"]
    assert [(g.name, g.window) for g in kv_cache_spec(CONFIGS["mistral"](), 16).groups] == [("sliding", WINDOW)]
    assert [g.name for g in kv_cache_spec(CONFIGS["llama"](), 16).groups] == ["full"]


def test_layer_types_rule_and_mistral_exception():
    config = SimpleNamespace(
        model_type="custom", num_hidden_layers=3, sliding_window=4, hidden_size=8, num_attention_heads=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    assert [s.group for s in layer_slots(config)] == ["sliding", "full", "sliding"]
    config.model_type = "mistral"  # Mistral applies its window to every layer, whatever layer_types says
    assert {s.group for s in layer_slots(config)} == {"sliding"}


def test_build_model_names_unsupported_architecture():
    config = CONFIGS["llama"]()
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM"):
        build_model(config)
    assert set(MODEL_REGISTRY) == {"Gemma3ForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                   "Qwen2ForCausalLM"}


def test_packed_weights_are_stored_for_the_one_row_gemv(pair, request):
    """In the ``onednn`` models every packed weight is stored as engine.models.packed.gemv_layout lays it
    ([out, in] for engine.native's few-row kernel; without it [in, out] where the output is at least as wide),
    a tied embedding included: the one-row matmuls that test_greedy_tokens_match_generate runs (batch 1) read
    them so, against transformers' tokens."""
    from engine.models.packed import PackedLinear
    from tests.engine.test_packed import stored_for_one_row

    arch, _, ours, config = pair
    linears = [m for m in ours.modules() if isinstance(m, PackedLinear)]
    if request.node.callspec.params["pair"][1] == "mkl":  # the model as built: packing is the onednn models' part
        assert not linears
        pytest.skip(f"{arch}: the mkl model: nothing packed, by design")
    assert linears, f"the {arch} onednn model packed nothing"
    weights = [m.weight for m in linears] + [m.qkv[0] for m in ours.modules() if getattr(m, "qkv", None)]
    if ours.tie_word_embeddings:
        weights.append(ours.model.embed_tokens.weight)
    for weight in weights:
        assert stored_for_one_row(weight)
