"""Which layer lands in which KV layer group, read from a Hugging Face config.

One group per distinct window: ``"full"`` (no window), ``"sliding"`` (the only
window), or ``"sliding_<W>"`` when a model has several windows. GPT-OSS with
``layer_types = [sliding, full, sliding, full]`` and ``sliding_window = 128``::

    layer id        0        1      2        3
    group       sliding   full  sliding   full
    index in group  0        0      1        1

Per-architecture rules (as ``transformers`` applies them):

- ``layer_types`` present (GPT-OSS, Qwen2): ``"sliding_attention"`` layers use
  ``sliding_window``, ``"full_attention"`` layers none. Qwen2's config already
  turns ``use_sliding_window`` / ``max_window_layers`` into ``layer_types`` and
  sets ``sliding_window = None`` when sliding is off.
- Mistral ignores ``layer_types``: every layer uses ``sliding_window`` (or none).
- Llama has no window.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcache.spec import KVCacheSpec, LayerGroup

FULL_GROUP = "full"
_LAYER_TYPES = ("full_attention", "sliding_attention")


class LayerSlot(NamedTuple):
    """Where one attention layer keeps its KV: group name, index within that group, its window."""

    group: str
    index: int
    window: int | None


def layer_windows(hf_config) -> list[int | None]:
    """Per layer id, the sliding window the model applies (None = full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None or hf_config.model_type == "mistral":
        return [window] * num_layers
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer types {unknown}; supported: {list(_LAYER_TYPES)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"{len(layer_types)} layer_types for {num_layers} layers")
    return [window if t == "sliding_attention" else None for t in layer_types]


def _group_name(window: int | None, sliding_windows: set[int]) -> str:
    if window is None:
        return FULL_GROUP
    return "sliding" if len(sliding_windows) == 1 else f"sliding_{window}"


def layer_slots(hf_config) -> list[LayerSlot]:
    """Per layer id, its (group, index within group, window)."""
    windows = layer_windows(hf_config)
    sliding = {w for w in windows if w is not None}
    counts: dict[str, int] = {}
    slots = []
    for window in windows:
        name = _group_name(window, sliding)
        slots.append(LayerSlot(name, counts.get(name, 0), window))
        counts[name] = counts.get(name, 0) + 1
    return slots


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads(hf_config) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def kv_cache_spec(hf_config, tokens_per_block: int, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    """The page geometry of ``hf_config``'s model; groups ordered by their first layer."""
    layers: dict[str, list[int]] = {}
    windows: dict[str, int | None] = {}
    for layer_id, slot in enumerate(layer_slots(hf_config)):
        layers.setdefault(slot.group, []).append(layer_id)
        windows[slot.group] = slot.window
    groups = tuple(LayerGroup(name, tuple(ids), windows[name]) for name, ids in layers.items())
    return KVCacheSpec(
        groups=groups,
        tokens_per_block=tokens_per_block,
        num_kv_heads=num_kv_heads(hf_config),
        head_dim=head_dim(hf_config),
        dtype=dtype,
    )
