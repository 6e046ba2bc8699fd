"""The native kernels on Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks), beside the
32-weight kinds, against gguf.quants.dequantize (what transformers' GGUF loader dequantizes with).

The gguf package quantizes none of the K-quants, so blocks are random bytes, and any bytes are a valid
block: f16 scales then include NaN and Inf (1 in 32), which must propagate as the reference's do.

Tolerance (``error_bound``): the few-row kernel sums each output in float32 in its fixed order, a group's
scale applied to the group's dot product (quant_gemv.cpp); the tiled GEMM in MKL's order. Both are sums of
at most ``depth`` rounded float32 operations per term, so by the standard bound each output is within
depth * 2^-24 of the sum of its terms' magnitudes, sum_j (|d(j) q_j| + |m|) |x_j| + |bias| (the offset's
terms counted apart: Q4_K's d q - dmin m may cancel). depth: a group's 4-term chain, two scalings, one
accumulator's share of the in / 32 groups (in / 16 scalings for Q6_K), the 8-lane tree and the offsets:
in / 32 + 16 covers the few-row kernel; in + 16 covers any order of the GEMM's in terms.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.loader import load_config, load_model
from engine.model_registry import resolve_model_path
from engine.models.quantized import BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedEmbedding, QuantizedLinear, QuantizedWeight
from engine.native import quant_linear_kernel, quant_matmul_kernel, quant_rows_kernel, set_pool_yields_kernel
from tests.engine import gguf_writer
from tests.engine.engine_fixtures import built_kernel
from tests.engine.helpers import PagedKV, greedy

NEW_KINDS = [Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
KINDS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, *NEW_KINDS]
# byte offsets of each block's f16 fields: the scale multiplying q first, then the offset's, if any
SCALE_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                Q.Q6_K: (208,)}
U32 = 2.0 ** -24  # float32's unit roundoff
# gguf's numpy dequantizer warns on the NaN and Inf scales that random bytes hold
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(scope="module")
def kernels():
    return built_kernel(quant_linear_kernel), built_kernel(quant_matmul_kernel), built_kernel(quant_rows_kernel)


def random_blocks(kind, out_features: int, num_blocks: int, seed: int) -> np.ndarray:
    """uint8 [out, num_blocks * block bytes], every byte random (f16 scales NaN or Inf 1 time in 32)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (out_features, num_blocks * BLOCK_BYTES[kind]), dtype=np.uint8)


def with_fields(blocks: np.ndarray, kind, values: dict[int, float]) -> np.ndarray:
    """A copy with f16 field ``offset`` of every block set to ``values[offset]``."""
    out = blocks.copy()
    per_block = out.reshape(out.shape[0], -1, BLOCK_BYTES[kind])
    for offset, value in values.items():
        per_block[..., offset:offset + 2] = np.float16(value).reshape(1).view(np.uint8)
    return out


def dequantized(blocks: np.ndarray, kind) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, kind).astype(np.float32, copy=False).copy())


def error_bound(blocks: np.ndarray, kind, x: torch.Tensor, bias: torch.Tensor | None, depth: int) -> torch.Tensor:
    """depth * 2^-24 * (sum_j (|d(j) q_j| + |m|) |x_j| + |bias|): the scaled part of each weight is the
    dequantization with the offset's f16 zeroed, the offset the dequantization with the scale's zeroed."""
    first, *offset = SCALE_FIELDS[kind]
    scaled = dequantized(with_fields(blocks, kind, dict.fromkeys(offset, 0.0)), kind).double().abs()
    magnitude = x.double().abs() @ scaled.T
    if offset:
        magnitude += x.double().abs() @ dequantized(with_fields(blocks, kind, {first: 0.0}), kind).double().abs().T
    if bias is not None:
        magnitude += bias.double().abs()
    return depth * U32 * magnitude


def assert_matches_reference(y: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """Non-finite exactly where the float64 reference is; elsewhere within ``bound``."""
    assert torch.equal(y.isfinite(), want.isfinite())
    finite = want.isfinite()
    error = (y.double() - want)[finite].abs()
    assert (error <= bound[finite]).all(), float((error / bound[finite]).max())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN at the same places, the same bits everywhere else (a NaN's payload is whichever NaN operand the
    CPU's instruction picked, which the compiler's choice of operand order decides)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def case(kind, out_features, in_blocks, rows, bias, seed):
    """(blocks, x, bias, the float64 reference x @ W.T + bias of gguf's dequantized W)."""
    blocks = random_blocks(kind, out_features, in_blocks, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_blocks * BLOCK_WEIGHTS[kind], generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    want = x.double() @ dequantized(blocks, kind).double().T
    return blocks, x, b, want if b is None else want + b.double()


shapes = dict(kind=st.sampled_from(KINDS), out_features=st.integers(1, 70), in_blocks=st.integers(1, 4),
              bias=st.booleans(), seed=st.integers(0, 2 ** 31))


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), out_features=st.integers(1, 70), in_blocks=st.integers(1, 4),
       seed=st.integers(0, 2 ** 31), num_rows=st.integers(1, 20))
def test_rows_dequantize_bit_for_bit_as_gguf(kernels, kind, out_features, in_blocks, seed, num_rows):
    """quant_rows gives gguf's float32 dequantization: NaN exactly where it has NaN, every other value
    (Inf, -0.0 and subnormals included) with the same bits."""
    _, _, rows = kernels
    blocks = random_blocks(kind, out_features, in_blocks, seed)
    index = torch.from_numpy(np.random.default_rng(seed).integers(0, out_features, num_rows))
    assert same_bits(rows(torch.from_numpy(blocks), int(kind), index), dequantized(blocks, kind)[index])


@settings(max_examples=50, deadline=None)
@given(**shapes, rows=st.integers(1, 8))
def test_few_rows_match_the_dequantized_product_and_not_the_rest_of_the_batch(kernels, kind, out_features,
                                                                             in_blocks, bias, seed, rows):
    """quant_linear within error_bound of the float64 product of gguf's dequantized weights, non-finite
    exactly where it is; row t of a T-row call has the bits of the 1-row call on row t."""
    linear, _, _ = kernels
    blocks, x, b, want = case(kind, out_features, in_blocks, rows, bias, seed)
    y = linear(x, torch.from_numpy(blocks), int(kind), b)
    assert_matches_reference(y, want, error_bound(blocks, kind, x, b, x.shape[1] // 32 + 16))
    for t in range(rows):
        assert same_bits(linear(x[t:t + 1], torch.from_numpy(blocks), int(kind), b)[0], y[t])


@settings(max_examples=25, deadline=None)
@given(**shapes, rows=st.integers(9, 40), tile_rows=st.integers(1, 64))
def test_many_rows_match_the_dequantized_product(kernels, kind, out_features, in_blocks, bias, seed, rows,
                                                 tile_rows):
    """quant_matmul (tiles dequantized, then torch's GEMM) within error_bound of the float64 product, NaN
    and Inf exactly where the reference has them (the same weights, multiplied as they are)."""
    _, matmul, _ = kernels
    blocks, x, b, want = case(kind, out_features, in_blocks, rows, bias, seed)
    y = matmul(x, torch.from_numpy(blocks), int(kind), b, tile_rows, False)
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf())
    assert_matches_reference(y, want, error_bound(blocks, kind, x, b, x.shape[1] + 16))


@pytest.mark.parametrize("kind", NEW_KINDS, ids=lambda k: k.name)
def test_a_nan_or_inf_scale_makes_only_its_own_outputs_non_finite(kernels, kind):
    """Weight row 0's scale NaN, row 1's +Inf, row 2's offset scale -Inf (where the kind has one): those
    outputs are NaN, non-finite, non-finite for every row of x; every other output is finite, within the
    error bound, whether 1, 5 or 20 rows are multiplied."""
    linear, matmul, rows = kernels
    first, *offset = SCALE_FIELDS[kind]
    blocks = with_fields(random_blocks(kind, 9, 2, 7), kind, {first: 0.01, **dict.fromkeys(offset, 0.01)})
    blocks[0, first:first + 2] = np.float16("nan").reshape(1).view(np.uint8)
    blocks[1, first:first + 2] = np.float16("inf").reshape(1).view(np.uint8)
    if offset:
        blocks[2, offset[0]:offset[0] + 2] = np.float16("-inf").reshape(1).view(np.uint8)
    weight = dequantized(blocks, kind)
    got = rows(torch.from_numpy(blocks), int(kind), torch.arange(9))
    assert same_bits(got, weight)
    bad = 3 if offset else 2
    for num_rows, multiply in ((1, linear), (5, linear), (20, lambda *a: matmul(*a, 4, False))):
        x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(num_rows))
        y = multiply(x, torch.from_numpy(blocks), int(kind), None)
        assert y[:, 0].isnan().all() and not y[:, 1:bad].isfinite().any() and y[:, bad:].isfinite().all()
        want = x.double() @ weight[bad:].double().T
        assert_matches_reference(y[:, bad:], want, error_bound(blocks[bad:], kind, x, None, x.shape[1] + 16))


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 8), out_features=st.integers(1, 2500), in_blocks=st.integers(1, 4),
       kind=st.sampled_from(NEW_KINDS), seed=st.integers(0, 10_000))
def test_few_rows_are_the_same_on_any_number_of_threads(kernels, rows, out_features, in_blocks, kind, seed):
    """Threads take chunks of whole rows (so whole super-blocks): 1, 2 or 3 threads give the same bits."""
    linear, _, _ = kernels
    blocks, x, _, _ = case(kind, out_features, in_blocks, rows, False, seed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = linear(x, torch.from_numpy(blocks), int(kind), None)
        for threads, yields in ((2, False), (3, True)):
            torch.set_num_threads(threads)
            set_pool_yields_kernel()(yields)
            assert same_bits(linear(x, torch.from_numpy(blocks), int(kind), None), want)
    finally:
        torch.set_num_threads(before)
        set_pool_yields_kernel()(False)


def test_quantized_weights_of_one_kind_concatenate_and_of_two_kinds_do_not(kernels):
    """What fuses q/k/v and gate/up (QuantizedWeight.cat) works on super-blocks; mixed kinds are refused."""
    q4k = QuantizedWeight(torch.from_numpy(with_fields(random_blocks(Q.Q4_K, 24, 3, 1), Q.Q4_K, {0: 0.1, 2: 0.1})),
                          int(Q.Q4_K))
    assert q4k.shape == (24, 768) and q4k.nbytes == 24 * 3 * 144
    parts = q4k.split([8, 16])
    fused = QuantizedWeight.cat(parts[::-1])
    assert fused.kind == int(Q.Q4_K) and torch.equal(fused.dequantize(), torch.cat([q4k.dequantize()[8:],
                                                                                    q4k.dequantize()[:8]]))
    q6k = QuantizedWeight(torch.from_numpy(random_blocks(Q.Q6_K, 8, 3, 2)), int(Q.Q6_K))
    with pytest.raises(ValueError, match="different kinds"):
        QuantizedWeight.cat([parts[0], q6k])
    with pytest.raises(ValueError, match="not Q5_K blocks"):
        QuantizedWeight(torch.zeros(4, 300, dtype=torch.uint8), int(Q.Q5_K))


# Gemma 3 270M Q4_K_M's mix of kinds (issue 50) on a small llama; its down_proj alternates Q6_K / Q4_K by
# layer, and layer 1 takes Q5_K and Q6_K for o / down so that every kind goes through a file
FILE_KINDS = [{"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K, "gate_proj": Q.Q5_0,
               "up_proj": Q.Q5_0, "down_proj": Q.Q6_K},
              {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q5_0, "o_proj": Q.Q5_K, "gate_proj": Q.Q5_0,
               "up_proj": Q.Q5_0, "down_proj": Q.Q4_K}]
FILE_CONFIG = dict(vocab_size=gguf_writer.VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                   tie_word_embeddings=True)
# an offset's scale per scale, centring the weights: dmin m_i ~ d sc_i E[q] (E[q] = 7.5, or 15.5 for Q5_K)
CENTRING = {Q.Q4_K: 7.5, Q.Q5_K: 15.5}


def weight_blocks(kind, out_features: int, in_features: int, seed: int, std: float = 0.05) -> np.ndarray:
    """Random blocks whose scales give weights of about ``std``, like a trained model's."""
    blocks = random_blocks(kind, out_features, in_features // BLOCK_WEIGHTS[kind], seed)
    first, *offset = SCALE_FIELDS[kind]
    unit = with_fields(blocks, kind, {first: 1.0, **dict.fromkeys(offset, CENTRING.get(kind, 0.0))})
    d = std / float(quants.dequantize(unit, kind).std())
    return with_fields(blocks, kind, {first: d, **dict.fromkeys(offset, CENTRING.get(kind, 0.0) * d)})


def write_mixed_gguf(path: str, config, state: dict[str, torch.Tensor], blocks: dict[str, tuple]) -> None:
    """``state`` as a llama GGUF (tests/engine/gguf_writer.py's metadata and tokenizer), the matrices of
    ``blocks`` (HF name -> (kind, blocks in HF row order)) stored as those bytes, q/k rows in llama.cpp's
    interleaved order."""
    writer = gguf.GGUFWriter(path, "llama")
    gguf_writer._add_hparams(writer, config)
    gguf_writer._add_tokenizer(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in sorted(state.items()):
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if hf_name not in blocks:
            writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
            continue
        kind, data = blocks[hf_name]
        data = gguf_writer._llama_layout("llama", hf_name, torch.from_numpy(data), config).numpy()
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    """(the GGUF file, its converted folder, the quantized model, the dense model, {HF name: kind})."""
    directory = tmp_path_factory.mktemp("kquants")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**FILE_CONFIG))
    state = {name: tensor.detach().clone() for name, tensor in reference.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied
    kinds = {"model.embed_tokens.weight": Q.Q8_0}
    for layer, mix in enumerate(FILE_KINDS):
        for proj, kind in mix.items():
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            kinds[f"model.layers.{layer}.{part}.{proj}.weight"] = kind
    blocks = {}
    for seed, (name, kind) in enumerate(sorted(kinds.items())):
        blocks[name] = (kind, weight_blocks(kind, *state[name].shape, seed))
        state[name] = dequantized(blocks[name][1], kind)
    path = str(directory / "mixed.gguf")
    write_mixed_gguf(path, reference.config, state, blocks)
    converted = resolve_model_path(path, cache_dir=str(directory / "cache"))
    assert torch.equal(load_file(f"{converted}/model.safetensors")["model.layers.0.mlp.down_proj.weight"],
                       state["model.layers.0.mlp.down_proj.weight"])  # transformers dequantized it as gguf does
    return path, converted, load_model(converted, gguf_path=path), load_model(converted), kinds


def test_a_gguf_file_of_mixed_kinds_loads_into_blocks_that_dequantize_to_its_weights(kernels, mixed_file):
    """Every matrix stays in its file's kind and dequantizes to the converted weights (the load-time check
    passed for each); q/k/v of mixed kinds stay three matmuls, of one kind are fused, as gate/up are."""
    _, _, ours, dense, kinds = mixed_file
    modules, dense_modules = dict(ours.named_modules()), dict(dense.named_modules())
    for name, kind in kinds.items():
        module = modules[name.removesuffix(".weight")]
        assert isinstance(module, QuantizedEmbedding if "embed" in name else QuantizedLinear), name
        assert module.weight.kind == int(kind), name
        assert torch.equal(module.weight.dequantize(), dense_modules[name.removesuffix(".weight")].weight), name
    first, second = ours.model.layers
    assert first.self_attn.qkv is None  # v_proj Q8_0, q/k Q5_0: three matmuls
    assert second.self_attn.qkv is not None and second.self_attn.qkv[0].kind == int(Q.Q5_0)
    for layer in (first, second):
        assert layer.mlp.gate_up is not None and layer.mlp.gate_up[0].kind == int(Q.Q5_0)


def test_a_gguf_file_of_mixed_kinds_generates_transformers_greedy_tokens(kernels, mixed_file):
    """The engine's model on the blocks (a 21-row prefill: the tiled GEMM; then 1-row steps: the few-row
    kernel) generates what transformers generates on the dequantized weights."""
    _, converted, ours, _, _ = mixed_file
    prompt = [(7 * i + 3) % 256 for i in range(21)]
    hf = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(ours, PagedKV.for_config(load_config(converted), 4), prompt, 12) == want
