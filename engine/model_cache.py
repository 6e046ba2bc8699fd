"""The cache folder of models the project writes itself, and how a model lands there.

Several processes (workers starting together) may write the same model at
once: each writes a private temporary folder next to the target and renames
it into place. ``os.rename`` of a folder is atomic and fails when the target
exists and is non-empty, so the first writer wins and the others discard
their copy and use its.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def default_cache_dir() -> str:
    return os.environ.get("WINDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "windserve")


def write_atomically(target: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a private folder next to ``target``, then rename it into place."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        write(tmp)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
