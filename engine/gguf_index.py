"""A GGUF file's tensor index, read without its metadata's arrays, and one tensor's bytes at a time.

gguf's ``GGUFReader`` makes a numpy view of every part of every metadata field. Gemma 3's file holds a
262,144-token vocabulary and 514,906 merges as string arrays: the reader took ~690 MiB to open it, more
than the model's weights. This reads what loading quantized weights needs (the scalar fields, each
tensor's name, shape, type and offset) and steps over arrays without keeping them::

    "GGUF"  version u32  tensors u64  fields u64
    field:  key (u64 length + bytes)  type u32  value    (an array: element type u32, count u64, elements)
    tensor: name  dims u32  shape u64 x dims  type u32  offset u64
    data:   from the end of the index rounded up to general.alignment (32 by default), plus each offset

A malformed or truncated file raises ``ValueError``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# scalar field types: struct format
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # as GGUF stores it: innermost (a row's length) first
    kind: int  # ggml's type id
    offset: int  # from the start of the file


class GGUFIndex:
    """``fields``: the scalar and string fields (arrays left out); ``tensors``: name -> TensorEntry."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            self.fields, self.tensors = _parse(data)

    def read(self, entry: TensorEntry, num_bytes: int) -> np.ndarray:
        """The tensor's first ``num_bytes`` bytes (its whole data, for the caller's type), as uint8."""
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            out = np.fromfile(f, dtype=np.uint8, count=num_bytes)
        if out.size != num_bytes:
            raise ValueError(f"{self.path!r}: {entry.name} is cut short ({out.size} of {num_bytes} bytes)")
        return out


def _parse(data) -> tuple[dict, dict[str, TensorEntry]]:
    reader = _Cursor(data)
    if reader.take(4) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version, num_tensors, num_fields = reader.unpack("<I"), reader.unpack("<Q"), reader.unpack("<Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    fields = {}
    for _ in range(num_fields):
        key = reader.string()
        value = reader.value(reader.unpack("<I"))
        if value is not None:
            fields[key] = value
    infos = []
    for _ in range(num_tensors):
        name = reader.string()
        shape = tuple(reader.unpack("<Q") for _ in range(reader.unpack("<I")))
        infos.append((name, shape, reader.unpack("<I"), reader.unpack("<Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-reader.pos // alignment) * alignment
    tensors = {name: TensorEntry(name, shape, kind, start + offset) for name, shape, kind, offset in infos}
    if any(entry.offset > len(data) for entry in tensors.values()):
        raise ValueError("a tensor's data lies past the end of the file (truncated?)")
    return fields, tensors


class _Cursor:
    def __init__(self, data) -> None:
        self.data, self.pos = data, 0

    def take(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise ValueError("the file ends inside its header (truncated?)")
        out = self.data[self.pos:self.pos + size]
        self.pos += size
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        """A scalar or string field's value; an array is stepped over (None)."""
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"unknown field type {kind}")
        element, count = self.unpack("<I"), self.unpack("<Q")
        if element in SCALARS:
            self.take(struct.calcsize(SCALARS[element]) * count)
        elif element == STRING:
            for _ in range(count):
                length = self.unpack("<Q")  # read before pos is: ``pos += unpack()`` adds to the old pos
                self.pos += length
        else:
            for _ in range(count):
                self.value(element)
        return None
