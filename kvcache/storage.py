"""Page memory: one tensor per layer group, one contiguous run per page.

    tensors[group]: [num_pages, num_layers_in_group, 2, B, num_kv_heads, head_dim]

Page ``p`` of a group starts ``p * page_nbytes`` bytes into its tensor and holds K
and V of every layer of the group for ``B`` consecutive positions, so one
transport descriptor moves one page, and a run of adjacent page ids is one
run of memory. A transport registers each group's tensor once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvcache.spec import KVCacheSpec


class PageStorage:
    def __init__(self, spec: KVCacheSpec, num_pages: Mapping[str, int], device: str | torch.device = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {
            g.name: torch.zeros((num_pages[g.name], *spec.page_shape(g)), dtype=spec.dtype, device=self.device)
            for g in spec.groups
        }

    def page(self, group: str, page_id: int) -> torch.Tensor:
        """View of one page: ``[num_layers_in_group, 2, B, num_kv_heads, head_dim]``."""
        return self.tensors[group][page_id]

    def page_nbytes(self, group: str) -> int:
        tensor = self.tensors[group]
        return tensor[0].numel() * tensor.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
