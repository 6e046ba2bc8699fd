"""float32 matmuls on the CPU through oneDNN, with each weight packed once at load.

MKL's ``addmm`` (what ``F.linear`` runs on the CPU) packs the weight on every
call. With few rows that packing is most of the call: an MoE decode step gives
each expert 4-14 rows, and a [512, 1024] expert matmul then took 340-500 us,
against 130 us for one row (a GEMV, no packing) and ~85 us to read its 2 MiB
once. oneDNN's linear takes a weight reordered ahead of time into its blocked
layout. Measured on the 2-core EPYC box, one thread, weights streamed from
memory (64 distinct [512, 1024] matrices, us per matmul)::

    rows            1     4     8    16    32    128   256
    MKL addmm     123   336   368   442   601   1630  2917
    oneDNN packed 171   140   179   234   393   1338  2478

so a matmul of two or more rows goes to oneDNN and one row (a batch-1 decode)
stays on MKL's GEMV. Where ``engine.native`` is built, up to ``NATIVE_MAX_ROWS`` rows go to
its few-row kernel instead (``rows_linear``, one memory stream per weight row, the weight
stored [out, in] in huge pages: [1024, 512] experts at 1 row ~25 GB/s against MKL's ~10,
at 4 rows ~16-19 against oneDNN's 10-15, at 5-8 rows about oneDNN's speed).

oneDNN's result for a row does not depend on how many rows it came with
(measured bit-identical in 1, 3 and 8 rows; MKL's is not), and differs from
MKL's by float32 rounding (about 1e-6 relative); so does the native kernel's.

The packed copy doubles the memory of the weights it covers (the original
stays: the one-row path, ``state_dict`` and GPUs use it). Only float32 CPU
weights are packed; everything else keeps ``F.linear`` / ``addmm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.hugepages import huge_page_copy
from engine.models.quantized import QuantizedWeight
from engine.native import rows_linear_kernel

# oneDNN picks its blocked layout for this many rows; measured the same speed for hints 8..256.
_ROWS_HINT = 32
# oneDNN's call costs ~10 us more than MKL's: for a weight in cache it wins from about [512, 256]
# (measured: [128, 256] at 8 rows 21 us against MKL's 11; [512, 512] 58 against 75).
MIN_PACKED_ELEMENTS = 1 << 17
# Up to this many rows a float32 CPU matmul on an [out, in] weight runs on engine.native's kernel
# (each row's result then does not depend on the others: a speculative verify of 1 + 4 drafts gives
# each row what a one-row decode gives it). Beyond, oneDNN's blocked GEMM is faster.
NATIVE_MAX_ROWS = 8


def can_pack(weight: torch.Tensor | QuantizedWeight, min_elements: int = MIN_PACKED_ELEMENTS) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() >= min_elements
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (``F.linear``'s layout) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)


def gemv_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [..., out, in] (``F.linear``'s shape, values unchanged) stored the way MKL's one-row GEMV
    reads it fastest: as a transposed view of an [in, out] tensor where ``out >= in``, contiguous
    [out, in] otherwise. Measured on the 2-core EPYC box, one thread, weights streamed from memory
    (GB/s of weight read; a one-thread copy moves ~21 GB/s, read + write)::

        in -> out        [in, out]  [out, in]
        576 -> 49152        19.6      10.8       SmolLM2's LM head
        512 -> 2048         20.9      10.1       gptoss-mid's expert gate_up
        576 -> 1536         17.5      11.3       SmolLM2's gate / up
        576 -> 960          15.4      11.0       SmolLM2's fused q/k/v
        1024 -> 512         12.6      15.3       gptoss-mid's expert down
        1536 -> 576         11.7      14.9       SmolLM2's down

    Only weights with a packed copy are laid out so (their matmuls of two or more rows read the packed
    copy); the one-row result differs from the other layout's by float32 rounding.

    Where engine.native's few-row kernel is built (float32 CPU weights), [..., out, in] in huge pages
    instead (``engine.models.hugepages``): what that kernel streams."""
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and rows_linear_kernel() is not None:
        return huge_page_copy(weight)
    if weight.shape[-2] >= weight.shape[-1]:
        return weight.transpose(-2, -1).contiguous().transpose(-2, -1)
    return weight.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [N, in]: engine.native's few-row kernel when N <= ``NATIVE_MAX_ROWS``
    and the float32 CPU weight is stored [out, in]; else oneDNN on ``packed`` when N >= 2; else MKL. A weight
    stored [in, out] (GPT-OSS's experts without the native kernel) comes as ``w.t()``: MKL then runs
    ``addmm(bias, x, w)``. A ``QuantizedWeight`` (GGUF blocks) takes its own few-row kernel up to
    ``NATIVE_MAX_ROWS`` rows, its tiled GEMM beyond (engine.models.quantized)."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias, is_few_rows=x.shape[0] <= NATIVE_MAX_ROWS)
    if x.shape[0] <= NATIVE_MAX_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32 \
            and x.device.type == "cpu" and weight.is_contiguous() and rows_linear_kernel() is not None:
        return rows_linear_kernel()(x.contiguous(), weight, bias)
    if packed is None or x.shape[0] < 2:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` (same parameters, same ``state_dict`` names) that also holds its packed weight."""

    def __init__(self, linear_module: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear_module.in_features, linear_module.out_features
        weight = linear_module.weight
        self.weight = nn.Parameter(gemv_layout(weight.detach()), requires_grad=weight.requires_grad)
        self.bias = linear_module.bias
        self.packed = pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the engine's [tokens, features]
            return linear(x, self.weight, self.bias, self.packed)
        rows = x.reshape(-1, x.shape[-1])
        return linear(rows, self.weight, self.bias, self.packed).view(*x.shape[:-1], self.out_features)


def pack_for_cpu(model: nn.Module, min_elements: int = MIN_PACKED_ELEMENTS) -> nn.Module:
    """Pack every float32 CPU ``nn.Linear`` of ``model`` with at least ``min_elements`` weights, and
    whatever a module packs itself (``pack_weights(min_elements)``: GPT-OSS's experts, a tied LM head,
    an attention layer's fused q/k/v, whose three ``nn.Linear`` then stay unpacked: they are not called).
    A no-op elsewhere. Weights must be loaded: a packed copy does not follow later changes."""
    for module in list(model.modules()):
        fused = ("q_proj", "k_proj", "v_proj") if getattr(module, "qkv", None) is not None else ()
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name not in fused and can_pack(child.weight, min_elements):
                setattr(module, name, PackedLinear(child))
        if hasattr(module, "pack_weights"):
            module.pack_weights(min_elements)
    return model
