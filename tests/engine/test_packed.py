"""engine.models.packed: oneDNN linears on packed float32 weights against torch's own matmuls."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from engine.models import packed as packed_module
from engine.models.gpt_oss import Experts
from engine.models.packed import PackedLinear, can_pack, gemv_layout, linear, pack, pack_for_cpu
from tests.engine.engine_fixtures import built_kernel

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1), 0), reason="no oneDNN in this torch build")


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), sizes=st.sampled_from([(8, 8), (32, 96), (96, 32), (128, 256), (512, 512)]),
       bias=st.booleans(), seed=st.integers(0, 1000))
def test_linear_on_packed_weight_equals_f_linear(rows, sizes, bias, seed):
    in_features, out_features = sizes
    x, weight = seeded(rows, in_features, seed=seed), seeded(out_features, in_features, seed=seed + 1)
    b = seeded(out_features, seed=seed + 2) if bias else None
    # sums of in_features products of N(0, 1) values, added in another order: float32 rounding grows with in_features
    torch.testing.assert_close(linear(x, weight, b, pack(weight)), F.linear(x, weight, b), rtol=1e-5,
                               atol=1e-6 * in_features)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 64), seed=st.integers(0, 1000))
def test_in_out_weight_packed_transposed_equals_addmm(rows, seed):
    x, weight, bias = seeded(rows, 48, seed=seed), seeded(48, 80, seed=seed + 1), seeded(80, seed=seed + 2)
    torch.testing.assert_close(linear(x, weight.t(), bias, pack(weight.t())), torch.addmm(bias, x, weight),
                               rtol=1e-5, atol=1e-5)


def stored_for_one_row(weight: torch.Tensor) -> bool:
    """Laid out as gemv_layout lays it: [..., out, in] where engine.native's few-row kernel is built;
    without it the wider side last."""
    if packed_module.rows_linear_kernel() is not None:
        return weight.is_contiguous()
    out_features, in_features = weight.shape[-2:]
    return (weight.transpose(-2, -1) if out_features >= in_features else weight).is_contiguous()


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(), (3,)]), out_features=st.integers(1, 96), in_features=st.integers(1, 96),
       seed=st.integers(0, 1000))
def test_gemv_layout_keeps_the_values_and_stores_the_wider_side_last(native, lead, out_features, in_features, seed):
    """[..., out, in] as F.linear reads it. Without engine.native's few-row kernel: out >= in is stored
    [..., in, out] (MKL's one-row GEMV then streams rows of the weight), otherwise [..., out, in]; with it,
    [..., out, in] (what the kernel streams). Shape and every value as they were."""
    if native:
        built_kernel(packed_module.rows_linear_kernel)
    weight = seeded(*lead, out_features, in_features, seed=seed)
    kernel = packed_module.rows_linear_kernel if native else (lambda: None)
    with mock.patch.object(packed_module, "rows_linear_kernel", kernel):
        laid = gemv_layout(weight)
        assert laid.shape == weight.shape and torch.equal(laid, weight)
        assert stored_for_one_row(laid)
    x = seeded(1, in_features, seed=seed + 1)
    w2d = laid.reshape(-1, out_features, in_features)[0]  # one matrix of the stack
    torch.testing.assert_close(F.linear(x, w2d), F.linear(x, weight.reshape(-1, out_features, in_features)[0]),
                               rtol=1e-5, atol=1e-5 * in_features)


def test_packed_row_does_not_depend_on_its_batch():
    """oneDNN computes each row alike in any batch of two or more rows (MKL does not promise that)."""
    x, weight = seeded(8, 512, seed=0), seeded(1024, 512, seed=1)
    packed = pack(weight)
    together = linear(x, weight, None, packed)
    assert torch.equal(linear(x[:3], weight, None, packed), together[:3])
    assert torch.equal(linear(x[5:7], weight, None, packed), together[5:7])


def test_pack_for_cpu_packs_large_float32_linears_only():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(16, 16), nn.Linear(512, 512).to(torch.bfloat16))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pack_for_cpu(model)
    assert [type(m) for m in model] == [PackedLinear, nn.Linear, nn.Linear]
    assert stored_for_one_row(model[0].weight)  # square: [in, out] for MKL's one-row GEMV, [out, in] for ours
    assert model[0].weight is not None and set(model.state_dict()) == set(state)  # same names, same tensors
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    x = seeded(3, 2, 512, seed=4)  # leading dims kept
    torch.testing.assert_close(model[0](x), F.linear(x, state["0.weight"], state["0.bias"]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("intermediate", [48, 96])  # 96: down_proj narrows (96 -> 64), stored [experts, out, in]
@pytest.mark.parametrize("num_tokens", [1, 5, 700])  # 700 x top-2 rows: several expert chunks
def test_packed_experts_equal_unpacked(num_tokens, intermediate):
    torch.manual_seed(0)
    plain, packed = (Experts(64, intermediate, 4, alpha=1.702, limit=7.0) for _ in range(2))
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.5)
    packed.load_state_dict(plain.state_dict())
    packed.pack_weights(min_elements=0)
    assert set(packed.packed) == {"gate_up_proj", "down_proj"}
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in plain.state_dict().items())
    # each expert's weight [out, in] as gemv_layout stores it (HF's shape is [experts, in, out])
    assert stored_for_one_row(packed.gate_up_proj.transpose(1, 2))
    assert stored_for_one_row(packed.down_proj.transpose(1, 2))
    x = seeded(num_tokens, 64, seed=3)
    weights, experts = seeded(num_tokens, 4, seed=5).topk(2, dim=-1)
    weights = weights.softmax(-1)
    # the same products summed in another order (oneDNN, engine.native's kernel, MKL): float32 rounding of
    # sums of 64 and `intermediate` terms of size ~1 apart
    torch.testing.assert_close(packed(x, experts, weights), plain(x, experts, weights), rtol=1e-5, atol=5e-5)


def test_engine_on_a_packed_model_generates_transformers_tokens(tmp_path):
    """A GPT-OSS-shaped model whose experts, fused q/k/v, o projection and head are large enough to be packed
    at load: the whole engine, four prompts batched, greedy, against transformers' generate."""
    from transformers import AutoModelForCausalLM

    from bench.common import build_gptoss_model
    from engine import LLM, SamplingParams

    path = build_gptoss_model(str(tmp_path), hidden_size=512, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=16)
    llm = LLM(path, device="cpu", tokens_per_block=8, num_pages=64, max_num_seqs=4)
    module = llm.engine.model.module
    layer = module.model.layers[0]
    assert layer.self_attn.qkv[2] is not None and isinstance(layer.self_attn.o_proj, PackedLinear)  # fused q/k/v
    assert set(layer.mlp.experts.packed) == {"gate_up_proj", "down_proj"}
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 19, 40, 64)]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            assert output.token_ids == want, f"prompt of {len(prompt)} tokens diverges"
