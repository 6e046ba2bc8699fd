"""Frozen descriptions of the KV cache: layer groups and page geometry.

A *layer group* is a set of layers that share one block table per request.
A model with alternating sliding-window and full-attention layers has two
groups; a model whose layers all use one window (or none) has one.

Page layout (one tensor per group, see ``PageStorage``)::

    storage[group]: [num_pages, num_layers_in_group, 2, tokens_per_block, num_kv_heads, head_dim]
                      page id    layer index in group  K/V  token slot       head          dim

Everything after the page index is contiguous, so one page is one run of
bytes holding K and V of every layer of its group for
``tokens_per_block`` consecutive positions. Adjacent page ids are adjacent
in memory, which is what lets a transport coalesce runs of pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one block table. ``window=None`` means full attention.

    Window convention (Hugging Face Mistral / GPT-OSS): the query at position
    ``q`` attends keys at positions ``[q - window + 1, q]``.
    """

    name: str
    layer_ids: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("LayerGroup needs a name")
        if not self.layer_ids:
            raise ValueError(f"LayerGroup {self.name!r} has no layers")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"LayerGroup {self.name!r} lists a layer twice")
        if self.window is not None and self.window < 1:
            raise ValueError(f"LayerGroup {self.name!r}: window must be >= 1, got {self.window}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry shared by every group: what a peer must agree on to exchange pages."""

    groups: tuple[LayerGroup, ...]
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError("num_kv_heads and head_dim must be >= 1")
        if not self.groups:
            raise ValueError("KVCacheSpec needs at least one layer group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate layer group names: {names}")
        layers = [layer for g in self.groups for layer in g.layer_ids]
        if len(set(layers)) != len(layers):
            raise ValueError("a layer belongs to more than one group")

    def group(self, name: str) -> LayerGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no layer group named {name!r}; have {[g.name for g in self.groups]}")

    def page_shape(self, group: LayerGroup) -> tuple[int, ...]:
        return (group.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def describe(self) -> dict:
        """Plain summary that two peers compare in a handshake."""
        return {
            "tokens_per_block": self.tokens_per_block,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "groups": [
                {"name": g.name, "layer_ids": list(g.layer_ids), "window": g.window}
                for g in self.groups
            ],
        }
