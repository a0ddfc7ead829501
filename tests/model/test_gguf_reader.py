"""GGUFHeader (model/loader/gguf_reader.py) against gguf's own GGUFReader: the same metadata, the
same tensor infos and bytes, on a file gguf.GGUFWriter writes (every metadata type, arrays of numbers
and strings, plain and block-quantised tensors, a non-default alignment) and on SmolLM2's; arrays
left unread until asked; damaged files refused with the reason."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from stagewise.model.loader.gguf_reader import ArrayRef, GGUFHeader
from stagewise.model.loader.sources import embedded_path


def _write(path, alignment: int = 64) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", alignment)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", -1.25)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**40)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, 1.5])
    w.add_array("t.strs", ["a", "", "ζ", "long " * 40])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 4)).astype(np.float16))
    blocks = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("q41", blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same_as_gguf(path) -> GGUFHeader:
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own entries for the header fields
        value = ours.metadata[key]
        if isinstance(value, ArrayRef):
            assert ours.array(key) == field.contents(), key
            assert ours.array_len(key) == len(field.contents())
        else:
            assert value == pytest.approx(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (tuple(a.shape), a.tensor_type.id, a.tensor_type.name, a.n_bytes) == \
            (tuple(int(d) for d in b.shape), int(b.tensor_type), b.tensor_type.name, b.n_bytes)
        assert np.array_equal(ours.data(a), b.data), a.name
    return ours


def test_header_equals_gguf_reader(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    h = _same_as_gguf(path)
    assert h.metadata["t.str"] == "héllo" and h.metadata["t.u64"] == 2**40
    assert isinstance(h.metadata["t.strs"], ArrayRef) and h.array("t.strs")[2] == "ζ"
    assert h.array("missing") is None and h.array_len("t.str") is None
    assert h.tensors[0].offset % 64 == 0  # the file's own alignment


def test_smollm2_header_equals_gguf_reader():
    try:
        path = embedded_path("smollm2-135m")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    h = _same_as_gguf(path)
    assert h.array_len("tokenizer.ggml.tokens") == 49152


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b"GGUX" + b[4:], "magic b'GGUX'"),
    (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "a big-endian file"),
    (lambda b: b[:200], "past the end of the file"),
    (lambda b: b[: len(b) - 100], "tensor 'q41' runs past the end of the file"),
    (lambda b: b"", "cannot mmap an empty file"),
])
def test_damaged_file_is_refused(tmp_path, damage, reason):
    """The header names the file and what is wrong, once; a checkpoint opened on it says no more."""
    from stagewise.model.loader.gguf_file import GGUFCheckpoint

    path = tmp_path / "t.gguf"
    _write(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match="is not a readable GGUF file") as err:
        GGUFHeader(path)
    assert reason in str(err.value)
    with pytest.raises(ValueError) as err:
        GGUFCheckpoint(path)
    assert str(err.value).count("is not a readable GGUF file") == 1 and reason in str(err.value)


def test_type_table_equals_gguf():
    """The reader's own table of the common GGML types (it spares importing gguf) against gguf's."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from stagewise.model.loader.gguf_reader import TensorType, _TYPES

    for type_id in _TYPES:
        kind = GGMLQuantizationType(type_id)
        assert TensorType.of(type_id) == TensorType(type_id, kind.name, *GGML_QUANT_SIZES[kind])
    assert TensorType.of(int(GGMLQuantizationType.IQ4_NL)).name == "IQ4_NL"  # one the table leaves to gguf
