"""engine.gguf_index against gguf's own reader, on files gguf's writer writes: the same scalar and string
fields, the same tensors (name, shape, type, data offset) and the same bytes; arrays are stepped over.
Truncated files fail with ValueError instead of giving wrong offsets."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf_index import GGUFIndex

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
FIELDS = st.dictionaries(
    st.text("abcdefghij.", min_size=1, max_size=10).map(lambda k: f"test.{k}"),
    st.one_of(st.tuples(st.just("u32"), st.integers(0, 2**32 - 1)),
              st.tuples(st.just("i64"), st.integers(-2**63, 2**63 - 1)),
              st.tuples(st.just("f32"), st.floats(width=32, allow_nan=False)),
              st.tuples(st.just("bool"), st.booleans()),
              st.tuples(st.just("str"), TEXT),
              st.tuples(st.just("strs"), st.lists(TEXT, max_size=20)),
              st.tuples(st.just("ints"), st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=20))),
    max_size=6)
TENSORS = st.lists(st.tuples(st.sampled_from(["F32", "Q8_0"]), st.integers(1, 5), st.integers(1, 3)),
                   min_size=1, max_size=4)
ADDERS = {"u32": "add_uint32", "i64": "add_int64", "f32": "add_float32", "bool": "add_bool", "str": "add_string",
          "strs": "add_array", "ints": "add_array"}


def write(path, fields: dict, tensors: list, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, value) in fields.items():
        getattr(writer, ADDERS[kind])(key, value)
    rng = np.random.default_rng(0)
    for i, (kind, rows, blocks) in enumerate(tensors):
        data = rng.standard_normal((rows, 32 * blocks)).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(f"t{i}", data)
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(f"t{i}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS, tensors=TENSORS, alignment=st.sampled_from([None, 64, 256]))
def test_fields_tensors_and_bytes_equal_ggufs_reader(tmp_path, fields, tensors, alignment):
    path = str(tmp_path / "model.gguf")
    write(path, fields, tensors, alignment)
    reader, index = gguf.GGUFReader(path), GGUFIndex(path)
    for key, (kind, value) in fields.items():
        if kind in ("strs", "ints"):
            assert key not in index.fields
        elif kind == "f32":
            assert index.fields[key] == np.float32(value)
        else:
            assert index.fields[key] == value
    assert index.fields["general.architecture"] == "llama"
    assert list(index.tensors) == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        ours = index.tensors[theirs.name]
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.kind == int(theirs.tensor_type)
        assert ours.offset == theirs.data_offset
        expected = np.asarray(theirs.data).view(np.uint8).reshape(-1)
        assert np.array_equal(index.read(ours, expected.size), expected)


def test_a_truncated_file_fails(tmp_path):
    path = tmp_path / "model.gguf"
    write(str(path), {"test.words": ("strs", ["a", "bb"] * 50)}, [("Q8_0", 4, 2)])
    whole = path.read_bytes()
    index = GGUFIndex(str(path))
    entry = index.tensors["t0"]
    size = 4 * 2 * 34  # 4 rows of 2 Q8_0 blocks
    assert entry.offset + size <= len(whole)  # the writer pads the file's end to the alignment
    for cut in (3, 40, 200, entry.offset - 8):  # in the magic, in the array, in the tensor index
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError):
            GGUFIndex(str(path))
    path.write_bytes(whole[:entry.offset + size - 1])  # the data one byte short
    with pytest.raises(ValueError, match="cut short"):
        GGUFIndex(str(path)).read(GGUFIndex(str(path)).tensors["t0"], size)
    path.write_bytes(b"GGUL" + whole[4:])
    with pytest.raises(ValueError, match="magic"):
        GGUFIndex(str(path))
