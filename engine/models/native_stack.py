"""Every layer of a few-row step in one native call (engine/native/decode_stack.cpp).

A decode step of SmolLM2 on the 2-core box spent ~6 of its 15 ms in Python around the kernels:
module calls, views, dispatch, ~200 us a layer. ``DecodeStack`` runs the same kernels and ATen ops in
the same order on the same views, so its hidden states equal the modules' bit for bit (tested). It holds
the GIL, as the modules' kernels do: releasing it measured no better in a serving worker (20.5 against
21.2 ms ITL), and a thread that takes the GIL back can wait a whole switch interval (5 ms).

A stack is built (once, at the first step it could serve) only for a model whose every layer is the
plain Llama-family layer: ``DecoderLayer`` of ``PagedSelfAttention`` (q/k/v fused, no sinks) and
``GatedMLP``, float32 norms, and linears that the modules would send to engine.native's few-row kernels
(GGUF blocks, or float32 ``PackedLinear`` / fused weights stored [out, in]). A step runs on it when it
has at most ``NATIVE_MAX_ROWS`` rows and every group's queries are attended in place (no bucket);
anything else takes the modules. ``WINDSERVE_NATIVE_STACK=0`` turns it off (A/B runs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.models.packed import NATIVE_MAX_ROWS, PackedLinear
from engine.models.quantized import QuantizedLinear, QuantizedWeight
from engine.native import decode_stack_class, rms_norm_kernel


def enabled() -> bool:
    return os.environ.get("WINDSERVE_NATIVE_STACK", "1") != "0"


class NativeStack:
    """A built ``DecodeStack`` and the layer groups' names in the ordinals it was built with."""

    def __init__(self, stack, groups: list[str]) -> None:
        self.stack, self.groups = stack, groups

    def fits(self, hidden: torch.Tensor, ctx) -> bool:
        """Whether this step is one the stack computes exactly as the modules would."""
        if ctx.static is not None or hidden.dtype != torch.float32 or hidden.device.type != "cpu" \
                or hidden.dim() != 2 or not 1 <= hidden.shape[0] <= NATIVE_MAX_ROWS:
            return False
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (ctx.cos, ctx.sin)):
            return False
        for group in self.groups:
            meta, cache = ctx.attention.get(group), ctx.kv_caches.get(group)
            if meta is None or meta.in_place is None or meta.buckets or cache is None \
                    or cache.dtype != torch.float32 or not cache.is_contiguous():
                return False
        return True

    def __call__(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        metas = [ctx.attention[g] for g in self.groups]
        places = [m.in_place for m in metas]
        return self.stack.run(hidden.contiguous(), ctx.cos, ctx.sin, [ctx.kv_caches[g] for g in self.groups],
                              [m.write_rows for m in metas], [p.first_rows for p in places],
                              [p.query_lens for p in places], [p.seq_lens for p in places],
                              [p.tables for p in places], [m.window or 0 for m in metas])


def build(model) -> NativeStack | None:
    """``model``'s stack (a ``DecoderForCausalLM`` with weights loaded, fused and packed), or None where a
    layer is not the plain Llama-family layer or a kernel is missing."""
    from engine.models.decoder import DecoderLayer, PagedSelfAttention
    from engine.models.layers import RMSNorm
    from engine.models.llama import GatedMLP

    stack_class = decode_stack_class()
    layers = list(model.model.layers)
    if stack_class is None or rms_norm_kernel() is None or not layers:
        return None
    first = layers[0].self_attn
    eps = layers[0].input_layernorm.eps
    groups = sorted({layer.self_attn.slot[0] for layer in layers if isinstance(layer, DecoderLayer)
                     and isinstance(layer.self_attn, PagedSelfAttention)})
    stack = stack_class(first.num_heads, first.num_kv_heads, first.head_dim, eps, first.scale)
    for layer in layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not PagedSelfAttention or attn.sinks is not None or attn.qkv is None \
                or (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) \
                != (first.num_heads, first.num_kv_heads, first.head_dim, first.scale):
            return None
        if type(mlp) is not GatedMLP or mlp.act_fn is not F.silu:  # the stack's MLP is SwiGLU
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(type(n) is RMSNorm and n.eps == eps and n.weight.dtype == torch.float32
                   and n.weight.device.type == "cpu" for n in norms):
            return None
        if mlp.gate_up is not None:
            gate, up = _spec(mlp.gate_up[0], mlp.gate_up[1]), (torch.empty(0), 0, None)
        else:
            gate, up = _module_spec(mlp.gate_proj), _module_spec(mlp.up_proj)
        specs = [_spec(attn.qkv[0], attn.qkv[1]), _module_spec(attn.o_proj), gate, up, _module_spec(mlp.down_proj)]
        if any(s is None for s in specs):
            return None
        group, index, _ = attn.slot
        stack.add_layer(norms[0].weight.detach(), norms[1].weight.detach(), [s[0] for s in specs],
                        [s[1] for s in specs], [s[2] for s in specs], groups.index(group), index)
    return NativeStack(stack, groups)


def _module_spec(module) -> tuple | None:
    """(weight, kind, bias) of a linear module the stack can run as the module would, else None."""
    if type(module) is QuantizedLinear:
        return _spec(module.weight, module.bias)
    if type(module) is PackedLinear:
        return _spec(module.weight, module.bias)
    return None  # a plain nn.Linear runs F.linear (MKL), not the few-row kernel


def _spec(weight, bias) -> tuple | None:
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return None
    bias = None if bias is None else bias.detach()
    if isinstance(weight, QuantizedWeight):
        return weight.blocks, weight.kind, bias
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous():
        return weight.detach(), 0, bias
    return None
