"""Shared helpers: build context and generation tables through the manager,
tag pages with the positions they hold, and check a planned transfer by content.

Expectations here come from positions alone (which keys a query at position
``P`` reads), never from the implementation's own arithmetic.
"""

from __future__ import annotations

import math

import torch

from kvcache import KVCacheManager, KVCacheSpec, LayerGroup

UNWRITTEN = -7.0


def make_spec(window: int | None, tokens_per_block: int) -> KVCacheSpec:
    groups = [LayerGroup("full", (1, 3))]
    if window is not None:
        groups.append(LayerGroup("sliding", (0, 2), window))
    return KVCacheSpec(tuple(groups), tokens_per_block, num_kv_heads=1, head_dim=2)


def build_pair(P: int, W: int | None, B: int, D: int, E: int, num_pages: int | None = None):
    """A context manager holding a P-token prompt, and a generation manager sized for it."""
    spec = make_spec(W, B)
    pages = num_pages or math.ceil((P + D + E) / B) + 4
    ctx = KVCacheManager(spec, pages)
    gen = KVCacheManager(spec, pages)
    # Offset the generation side so page ids differ from ordinals on both sides.
    gen.allocate("other", B * 2, num_computed_tokens=0)
    ctx.allocate("req", P, num_extra_kv_tokens=E, include_drafts=False)
    gen.allocate("req", P, num_computed_tokens=P, draft_len=D, num_extra_kv_tokens=E)
    gen.free("other")
    for manager in (ctx, gen):
        for tensor in manager.storage.tensors.values():
            tensor.fill_(UNWRITTEN)
    tag_prompt(ctx, "req", P)
    return spec, ctx, gen


def tag(position: int, layer: int, kv: int) -> float:
    return float(position * 100 + layer * 10 + kv + 1)


def tag_prompt(manager: KVCacheManager, request_id: str, P: int) -> None:
    """Write into each bound page the tag of every position it holds."""
    B = manager.spec.tokens_per_block
    for group in manager.spec.groups:
        for ordinal, page in enumerate(manager.get_block_ordinals(request_id, group.name)):
            if page < 0:
                continue
            view = manager.storage.page(group.name, page)
            for slot in range(B):
                position = ordinal * B + slot
                if position >= P:
                    break
                for layer in range(group.num_layers):
                    for kv in (0, 1):
                        view[layer, kv, slot].fill_(tag(position, layer, kv))


def needed_ordinals(P: int, W: int | None, B: int) -> list[int]:
    """Blocks holding a prompt position that the query at position P reads."""
    lowest = 0 if W is None else P - W + 1
    return [i for i in range(math.ceil(P / B)) if any(lowest <= p < P for p in range(i * B, (i + 1) * B))]


def execute(plan, ctx: KVCacheManager, gen: KVCacheManager, group: str) -> None:
    for _, src, dst in plan:
        gen.storage.page(group, dst).copy_(ctx.storage.page(group, src))


def check_received(gen: KVCacheManager, request_id: str, group: str, P: int, W: int | None) -> list[str]:
    """Problems with what the generation side holds after a transfer (empty = correct)."""
    B = gen.spec.tokens_per_block
    layers = gen.spec.group(group).num_layers
    table = gen.get_block_ordinals(request_id, group)
    problems = []
    needed = set(needed_ordinals(P, W, B))
    for ordinal, page in enumerate(table):
        if page < 0:
            if ordinal in needed:
                problems.append(f"ordinal {ordinal} needed but unbound")
            continue
        view = gen.storage.page(group, page)
        for slot in range(B):
            position = ordinal * B + slot
            for layer in range(layers):
                for kv in (0, 1):
                    got = view[layer, kv, slot, 0, 0].item()
                    want = tag(position, layer, kv) if ordinal in needed and position < P else UNWRITTEN
                    if got != want:
                        problems.append(f"ordinal {ordinal} slot {slot} layer {layer}: {got} != {want}")
                        break
    return problems


