"""GGUF weights kept in their quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) on the CPU, for
float32 activations.

A decode step streams every weight once; in Q4_1 that is 5 bits a weight instead of float32's 32.
``QuantizedWeight`` stands where a float32 weight tensor stands in ``engine.models.packed.linear``::

    rows of x   path                                                        (engine/native)
    <= 8        each block widened to float32 in registers, dotted with x   quant_linear (quant_gemv.cpp)
    > 8         tiles of ~256 K weights dequantized, then torch's GEMM      quant_matmul (quant.cpp)
                in ``prefill_dtype``

Activations are never quantized: the result equals the dequantized float32 model's up to float32
rounding, and a row's result does not depend on the other rows of its batch (up to 8 rows). With
``prefill_dtype`` bfloat16 (EngineConfig's ``prefill_dtype``), steps of more than 8 rows round x and the
weight tiles to bf16 and the GEMM's output too (oneDNN's AMX kernel where the CPU has one: ~6x float32's
GEMM on the 2-core Intel box, bench/README): prefills are faster, and their K/V, logits and first tokens
are those of a bf16 matmul, no longer the float32 model's.

``quantize_gguf_weights`` swaps a loaded model's ``nn.Linear`` / ``nn.Embedding`` modules for
``QuantizedLinear`` / ``QuantizedEmbedding`` holding the file's blocks, where the file stores that
tensor in one of those formats (everything else, norms included, stays as loaded). GGUF's llama
architecture stores q/k rows interleaved per head (engine.gguf's writer notes why); quantization runs
along a row, so those rows are put back in Hugging Face's order whole, blocks untouched. A file may mix
kinds (Gemma 3's Q4_K_M: Q5_0 q/k/gate/up, Q8_0 or Q5_0 v, Q4_K o, Q6_K or Q4_K down): each weight keeps
its own, and q/k/v or gate/up are fused into one weight only where their kinds agree (``QuantizedWeight.cat``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.gguf_index import GGUFIndex, TensorEntry
from engine.loader import ModelLoadError
from engine.models.hugepages import huge_page_copy
from engine.native import quant_linear_kernel, quant_matmul_kernel, quant_rows_kernel

logger = logging.getLogger(__name__)

# ggml's type ids, as GGUF files store them; each block holds BLOCK_WEIGHTS weights of one row in BLOCK_BYTES
# (engine/native/quant_blocks.h shows the layouts): 32, or 256 for a K-quant's super-block
KIND_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 8: 34, 12: 144, 13: 176, 14: 210}
BLOCK_WEIGHTS = {2: 32, 3: 32, 6: 32, 8: 32, 12: 256, 13: 256, 14: 256}
# Weights dequantized per tile of a prefill's GEMM (1 MiB of float32; SmolLM2's [1536, 576] matmul of
# 400 rows measured 9-10 ms at tiles of 128-1536 rows, the float32 weight's own GEMM 9.4 ms).
PREFILL_TILE_WEIGHTS = 1 << 18
# in bf16 (2 MiB): a 400-token SmolLM2 prefill took 212 ms against 255 at 1 << 18 (fewer, larger AMX GEMMs)
PREFILL_TILE_WEIGHTS_BF16 = 1 << 20
NUM_CHECKED_ROWS = 3  # rows of each tensor compared with the dequantized weights at load


DenseRows = Callable[[str, list[int]], torch.Tensor]  # (weight name, row indices) -> float32 [len(rows), in]


def kernels_available() -> bool:
    return quant_linear_kernel() is not None


class QuantizedWeight:
    """A weight [out, in] as GGUF blocks: ``blocks`` uint8 [out, in / BLOCK_WEIGHTS * BLOCK_BYTES] of ggml's
    type id ``kind``."""

    dtype = torch.float32  # what its matmuls produce (the model's compute dtype)
    device = torch.device("cpu")

    def __init__(self, blocks: torch.Tensor, kind: int, prefill_dtype: torch.dtype = torch.float32) -> None:
        if kind not in BLOCK_BYTES or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] % BLOCK_BYTES[kind]:
            raise ValueError(f"not {KIND_NAMES.get(kind, kind)} blocks: {blocks.dtype} {tuple(blocks.shape)}")
        if prefill_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"prefill_dtype must be float32 or bfloat16, got {prefill_dtype}")
        self.blocks, self.kind, self.prefill_dtype = blocks, kind, prefill_dtype
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind]))

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, is_few_rows: bool) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 x [N, in]: the few-row kernel when ``is_few_rows``."""
        if is_few_rows:
            return quant_linear_kernel()(x.contiguous(), self.blocks, self.kind, bias)
        bf16 = self.prefill_dtype == torch.bfloat16
        tile = max(1, (PREFILL_TILE_WEIGHTS_BF16 if bf16 else PREFILL_TILE_WEIGHTS) // self.shape[1])
        return quant_matmul_kernel()(x, self.blocks, self.kind, bias, tile, bf16)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64 [n]) dequantized: float32 [n, in]."""
        return quant_rows_kernel()(self.blocks, self.kind, index.contiguous())

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))

    def split(self, sizes: list[int]) -> list[QuantizedWeight]:
        """Views of consecutive row ranges (no copy)."""
        return [QuantizedWeight(part, self.kind, self.prefill_dtype) for part in self.blocks.split(sizes)]

    @staticmethod
    def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        kinds = {(w.kind, w.prefill_dtype) for w in weights}
        if len(kinds) != 1:
            raise ValueError(f"cannot concatenate weights of different kinds or prefill dtypes: "
                             f"{sorted(map(str, kinds))}")
        return QuantizedWeight(huge_page_copy(torch.cat([w.blocks for w in weights])), *kinds.pop())


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight stays in GGUF blocks (its bias, if any, stays a float32 parameter)."""

    def __init__(self, linear_module: nn.Linear, weight: QuantizedWeight) -> None:
        super().__init__()
        self.in_features, self.out_features = linear_module.in_features, linear_module.out_features
        self.weight = weight
        self.bias = linear_module.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.models.packed import linear  # packed imports this module

        rows = x.reshape(-1, x.shape[-1])
        return linear(rows, self.weight, self.bias, None).view(*x.shape[:-1], self.out_features)


class QuantizedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table stays in GGUF blocks; looked-up rows are dequantized."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids.reshape(-1).long()).view(*ids.shape, self.embedding_dim)


def hf_row_order(blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from llama.cpp's interleaved pairs back to Hugging Face's halves::

        file rows of a head:  r0 of half 0, r0 of half 1, r1 of half 0, r1 of half 1, ...
        HF rows of a head:    half 0 (r0, r1, ...), then half 1 (r0, r1, ...)
    """
    rows = blocks.shape[0]
    return blocks.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(blocks.shape)


def quantize_gguf_weights(model: nn.Module, gguf_path: str, prefill_dtype: torch.dtype = torch.float32,
                          dense_rows: DenseRows | None = None) -> list[str]:
    """Swap ``model``'s linears and embedding for quantized ones holding ``gguf_path``'s blocks, where the
    file stores the weight in one of KIND_NAMES' formats; the swapped weights' names (``x.weight``).
    ``prefill_dtype``: the dtype of their many-row matmuls (``QuantizedWeight``).

    A few rows of each are compared with the same weights dequantized (engine.gguf's converted folder), so a
    file that does not match the model fails here instead of generating garbage: ``dense_rows(name, rows)``
    reads them (engine.loader.WeightFiles.rows, so that a dense weight is never held whole), or, without it,
    ``model`` holds them (loaded before)."""
    import gguf

    try:
        index = GGUFIndex(gguf_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{gguf_path!r} is not a readable GGUF file: {e}") from e
    architecture = str(index.fields.get("general.architecture"))
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], config.num_hidden_layers)
    tensors = index.tensors
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) not in (nn.Linear, nn.Embedding):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            tensor = tensors.get(names.get_name(f"{name}.weight", try_suffixes=(".weight",)) or "")
            if tensor is None or tensor.kind not in BLOCK_BYTES or len(tensor.shape) != 2:
                continue
            weight = _weight_of(index, tensor, name, architecture, config, prefill_dtype)
            rows = _checked_rows(child.weight.shape)
            dense = (child.weight.detach().float().index_select(0, rows) if dense_rows is None
                     else dense_rows(f"{name}.weight", rows.tolist()))
            _check_matches(weight, child.weight.shape, rows, dense, name, gguf_path)
            module = QuantizedEmbedding(weight) if type(child) is nn.Embedding else QuantizedLinear(child, weight)
            setattr(parent, child_name, module)
            swapped.append(f"{name}.weight")
    logger.info("%s: %d weights kept quantized", gguf_path, len(swapped))
    return swapped


def _weight_of(index: GGUFIndex, tensor: TensorEntry, name: str, architecture: str, config,
               prefill_dtype: torch.dtype) -> QuantizedWeight:
    row_length, num_rows = tensor.shape  # GGUF's shape is [in, out], a row per output
    if row_length % BLOCK_WEIGHTS[tensor.kind]:
        raise ModelLoadError(f"{index.path!r}: {tensor.name}'s rows of {row_length} are not whole "
                             f"{KIND_NAMES[tensor.kind]} blocks")
    row_bytes = row_length // BLOCK_WEIGHTS[tensor.kind] * BLOCK_BYTES[tensor.kind]
    try:
        data = index.read(tensor, num_rows * row_bytes)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    blocks = torch.from_numpy(data).reshape(num_rows, row_bytes)
    if architecture == "llama" and name.endswith((".q_proj", ".k_proj")):
        heads = config.num_attention_heads if name.endswith(".q_proj") else config.num_key_value_heads
        blocks = hf_row_order(blocks, heads)
    return QuantizedWeight(huge_page_copy(blocks), tensor.kind, prefill_dtype)


def _checked_rows(shape: torch.Size) -> torch.Tensor:
    return torch.linspace(0, shape[0] - 1, NUM_CHECKED_ROWS).long().unique()


def _check_matches(weight: QuantizedWeight, shape: torch.Size, rows: torch.Tensor, dense: torch.Tensor, name: str,
                   path: str) -> None:
    """``weight`` has the model's ``shape``, and its ``rows`` dequantize to ``dense``, bit for bit."""
    if weight.shape != shape:
        raise ModelLoadError(f"{path!r}: {name} is {tuple(weight.shape)} in the file, {tuple(shape)} in the model")
    if not torch.equal(weight.rows(rows), dense.float()):
        raise ModelLoadError(f"{path!r}: {name}'s {KIND_NAMES[weight.kind]} blocks do not dequantize to the "
                             "converted weights")
