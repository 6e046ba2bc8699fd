"""What two workers must agree on to exchange KV pages."""

from __future__ import annotations

from engine import LLMEngine

PAGE_LAYOUT = "page,layer_in_group,kv,token,head,dim"


def compat_descriptor(engine: LLMEngine) -> dict:
    """Model, dtype, page geometry and layer groups with their windows."""
    spec = engine.manager.spec.describe()
    return {
        "model": engine.config.model,
        "page_layout": PAGE_LAYOUT,
        **spec,
    }
