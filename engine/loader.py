"""Loading a local Hugging Face-format model directory: config, weights, model.

Only local directories are read; nothing is downloaded. Every failure is a
``ModelLoadError`` that names the file, tensor or architecture at fault.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

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


class WeightFiles:
    """The directory's safetensors tensors by name (``model.safetensors`` or the index's shards, as
    ``load_state_dict`` reads them), each read from its file only when asked for: a loader that keeps some
    weights in another form (engine.models.quantized) never holds those dense."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        path = _require_dir(path)
        if os.path.isfile(os.path.join(path, SINGLE_FILE)):
            file = os.path.join(path, SINGLE_FILE)
            with self._open(safe_open, file) as f:
                self._file_of = dict.fromkeys(f.keys(), file)
        elif os.path.isfile(os.path.join(path, INDEX_FILE)):
            self._file_of = {name: os.path.join(path, shard) for name, shard in
                             _read_weight_map(os.path.join(path, INDEX_FILE)).items()}
            missing = sorted({f for f in self._file_of.values() if not os.path.isfile(f)})
            if missing:
                raise ModelLoadError(f"{path!r}: the index lists shard files that are missing: {_few(missing)}")
        else:
            raise ModelLoadError(f"{path!r} has no safetensors weights: expected {SINGLE_FILE} or {INDEX_FILE}")

    @staticmethod
    def _open(safe_open, file: str):
        from safetensors import SafetensorError

        try:
            return safe_open(file, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {file!r}: {e}") from e

    def names(self) -> list[str]:
        return list(self._file_of)

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            with self._open(safe_open, self._file_of[name]) as f:
                return f.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {name!r} from {self._file_of[name]!r}: {e}") from e

    def rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows ``rows`` of the 2-D tensor ``name``, read without the rest of it."""
        from safetensors import SafetensorError, safe_open

        try:
            with self._open(safe_open, self._file_of[name]) as f:
                part = f.get_slice(name)
                return torch.cat([part[r:r + 1] for r in rows])
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {name!r} from {self._file_of[name]!r}: {e}") from e


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

    if gguf_path is None:
        model = build_model(load_config(path), dtype=dtype, device=device)
        load_weights(model, load_state_dict(path))
        return pack_for_cpu(fuse_projections(model.eval()))
    # The weights the file keeps quantized are never dense in memory: the model is built without
    # initialising its linears (their float32 pages are never touched), they are swapped for the file's
    # blocks (checked against a few rows of the converted folder's), and only the rest is read.
    with uninitialized_linears():
        model = build_model(load_config(path), dtype=dtype, device=device)
    files = WeightFiles(path)
    swapped = set(quantize_gguf_weights(model, gguf_path, prefill_dtype, files.rows))
    load_weights(model, {name: files.tensor(name) for name in files.names() if name not in swapped})
    return pack_for_cpu(fuse_projections(model.eval()))


@contextmanager
def uninitialized_linears():
    """``nn.Linear`` and ``nn.Embedding`` built without initialising their weights (``torch.empty``'s)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved
