"""Loading a local Hugging Face-format model directory: config, weights, model.

Only local directories are read; nothing is downloaded. Every failure is a
``ModelLoadError`` that names the file, tensor or architecture at fault.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
NUM_NAMES_SHOWN = 5


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with the reason."""


def _require_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    return path


def _few(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:NUM_NAMES_SHOWN])
    more = len(names) - NUM_NAMES_SHOWN
    return f"{shown} (and {more} more)" if more > 0 else shown


def load_config(path: str):
    """The directory's ``config.json`` as a ``transformers.PretrainedConfig``."""
    from transformers import AutoConfig

    path = _require_dir(path)
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ModelLoadError(f"{path!r} has no {CONFIG_FILE}")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read {os.path.join(path, CONFIG_FILE)}: {e}") from e


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors``, or of the shards in ``model.safetensors.index.json``."""
    path = _require_dir(path)
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):  # preferred over an index, as transformers does
        return _load_file(os.path.join(path, SINGLE_FILE))
    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        return _load_sharded(path)
    raise ModelLoadError(f"{path!r} has no safetensors weights: expected {SINGLE_FILE} or {INDEX_FILE}")


def _load_file(file: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read {file!r}: {e}") from e


def _read_weight_map(index_file: str) -> dict[str, str]:
    try:
        with open(index_file, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_file!r} is not a safetensors index with a weight_map: {e!r}") from e
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index_file!r}: weight_map must map tensor names to shard files")
    return weight_map


def _load_sharded(path: str) -> dict[str, torch.Tensor]:
    index_file = os.path.join(path, INDEX_FILE)
    weight_map = _read_weight_map(index_file)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
    if missing:
        raise ModelLoadError(f"{index_file!r} lists shard files that are missing: {_few(missing)}")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = _load_file(os.path.join(path, shard))
        wanted = [name for name, file in weight_map.items() if file == shard]
        absent = [name for name in wanted if name not in tensors]
        if absent:
            raise ModelLoadError(f"shard {shard!r} lacks tensors that {INDEX_FILE} places in it: {_few(absent)}")
        state_dict.update((name, tensors[name]) for name in wanted)
    return state_dict


def check_architecture(hf_config, registry: Mapping[str, type]) -> str:
    """The config's one architecture name, if the registry has a model for it."""
    architectures = getattr(hf_config, "architectures", None) or []
    supported = ", ".join(sorted(registry)) or "none"
    if len(architectures) != 1:
        raise ModelLoadError(f"the model config must name exactly one architecture, got {architectures}; "
                             f"supported: {supported}")
    if architectures[0] not in registry:
        raise ModelLoadError(f"unsupported architecture {architectures[0]!r}; supported: {supported}")
    return architectures[0]


def load_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``, cast to each parameter's dtype and device.

    ``strict=True``: every name and shape must fit. A tied tensor is stored
    once in a checkpoint; the model itself says so (engine.models' decoders
    have no ``lm_head`` when tied and drop a redundant copy on load).
    """
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:  # torch's message names the missing, unexpected and mis-shaped tensors
        raise ModelLoadError(f"the checkpoint does not fit the model: {e}") from e


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               gguf_path: str | None = None, prefill_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the engine's model for the directory's architecture and load its weights, in eval mode,
    each layer's q/k/v fused into one matmul, float32 CPU weights packed for oneDNN (engine.models.packed).
    With ``gguf_path`` (the file ``path`` was converted from; float32 on the CPU only), the weights the file
    stores quantized stay in its blocks (engine.models.quantized) and are neither fused dense nor packed;
    ``prefill_dtype`` is their many-row matmuls' dtype."""
    from engine.models import build_model  # engine.models imports this module: import at call time
    from engine.models.decoder import fuse_projections
    from engine.models.packed import pack_for_cpu
    from engine.models.quantized import quantize_gguf_weights

    model = build_model(load_config(path), dtype=dtype, device=device)
    load_weights(model, load_state_dict(path))
    if gguf_path is not None:
        quantize_gguf_weights(model, gguf_path, prefill_dtype)
    return pack_for_cpu(fuse_projections(model.eval()))
