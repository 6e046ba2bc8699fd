"""GGUF checkpoints (llama.cpp's one-file format) turned, once, into a Hugging Face folder.

    model.gguf ──read_architecture()──► supported? ──transformers' GGUF loader──► a cache folder
                (no tensor data is      gemma3, llama,   (dequantizes every tensor
                 dequantized)           qwen2; else      to float32)
                                        an error

    <cache>/gguf/<file stem>-<key>/     key: this converter's version, the file's real path, size, mtime
        config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json ...

The folder then loads like any other (engine.loader, engine.tokenizer): the
tokenizer and its chat template come from the GGUF metadata, through
transformers. It is written into a private temporary folder and renamed into
place (as engine.tiny does); a lock file makes racing processes (a context and
a generation worker starting together) wait for one conversion instead of
each running their own.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import contextmanager

from engine.loader import ModelLoadError
from engine.model_cache import write_atomically

GGUF_SUFFIX = ".gguf"
CONVERTER_VERSION = 1  # bump when the folder written for the same file changes
# The GGUF general.architecture values converted. llama.cpp writes Mistral models as ``llama`` (the
# same dense decoder; it runs them with full attention) and they convert to LlamaForCausalLM.
SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "qwen2")
INSTALL_HINT = "pip install gguf accelerate"


def is_gguf_path(name_or_path: str) -> bool:
    return name_or_path.lower().endswith(GGUF_SUFFIX)


def read_architecture(path: str) -> str:
    """The file's general.architecture; ModelLoadError when it is missing, corrupt or truncated.

    gguf's reader checks the magic and maps every tensor's bytes, so a file
    cut short fails here, before any conversion.
    """
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    reader_cls = _reader_class()
    try:
        reader = reader_cls(path)
        architecture = _string_field(reader, "general.architecture")
    except Exception as e:  # the reader parses untrusted bytes: any failure means "not a readable GGUF"
        raise ModelLoadError(f"{path!r} is not a readable GGUF file (corrupt or truncated?): "
                             f"{type(e).__name__}: {e}") from e
    return architecture


def _reader_class():
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ModelLoadError(f"reading GGUF files needs the gguf package: {INSTALL_HINT}") from e
    return GGUFReader


def _string_field(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"no {key} field")
    return str(field.contents())


def check_supported(architecture: str, path: str) -> None:
    """ModelLoadError naming the file's architecture unless windserve converts it."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path!r}: GGUF architecture {architecture!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} (Mistral models are written as llama)")


def converted_dirname(path: str) -> str:
    """``<stem>-<key>``: a new file at the same path (another size or mtime) gets a new folder."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    identity = f"{CONVERTER_VERSION}|{real}|{stat.st_size}|{stat.st_mtime_ns}"
    stem = os.path.basename(real)[: -len(GGUF_SUFFIX)]
    return f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def ensure_converted(path: str, cache_dir: str) -> str:
    """The Hugging Face folder of the GGUF file at ``path``, converting it on first use.

    A folder already in the cache is returned without reading the file again
    (its name pins the file's identity); otherwise the header is checked first,
    so an unsupported or corrupt file fails before transformers is involved.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    parent = os.path.join(os.path.abspath(cache_dir), "gguf")
    target = os.path.join(parent, converted_dirname(path))
    if os.path.isdir(target):
        return target
    check_supported(read_architecture(path), path)
    os.makedirs(parent, exist_ok=True)
    with _locked(target + ".lock"):
        if not os.path.isdir(target):  # another process may have converted it while this one waited
            write_atomically(target, lambda tmp: convert(path, tmp))
    return target


@contextmanager
def _locked(lock_path: str):
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert(path: str, directory: str) -> None:
    """Dequantize ``path`` with transformers' GGUF loader and save it as a Hugging Face folder.

    transformers refuses to ``save_pretrained`` a model it loaded from GGUF
    (it counts as quantized), so the float32 state dict, the config and the
    generation config are saved here; a tied ``lm_head`` is left out, as
    ``save_pretrained`` does.
    """
    tokenizer, model = _load_with_transformers(path)
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):  # GGUF's marker; the saved float32 weights are plain
        del config.quantization_config
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _load_with_transformers(path: str):
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelLoadError(f"loading GGUF files needs transformers, gguf and accelerate: {INSTALL_HINT}") from e
    folder, name = os.path.split(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ImportError, ValueError, KeyError, OSError, RuntimeError) as e:
        raise ModelLoadError(f"cannot convert GGUF file {path!r}: {type(e).__name__}: {e}") from e
    return tokenizer, model
