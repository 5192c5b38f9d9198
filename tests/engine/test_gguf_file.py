"""engine_native/model/gguf_file.py reads what gguf-py's GGUFReader reads (every key/value with its Python type,
every tensor's dtype, shape and bytes), on the bundled model and on a file written by gguf-py's own writer with
every value type; and a file it cannot read is refused with ValueError (ModelLoadError from the loaders), never
another exception, whatever byte it ends at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from engine_native.model.bundled import bundled_model_path
from engine_native.model.errors import ModelLoadError
from engine_native.model.gguf_file import read_gguf
from engine_native.model.inspect import inspect_model
from engine_native.model.tokenizer_loader import load_tokenizer


def _gguf_py(path: str) -> tuple[dict[str, Any], list[Any]]:
    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, reader.tensors


def _assert_same_as_gguf_py(path: str) -> None:
    header = read_gguf(path)
    meta, tensors = _gguf_py(path)
    assert list(header.meta) == list(meta)
    for key, value in meta.items():
        ours = header.meta[key]
        assert ours == value and type(ours) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in ours} == {type(v) for v in value}, key
    assert [t.name for t in header.tensors] == [t.name for t in tensors]
    for ours, theirs in zip(header.tensors, tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
        assert ours.n_elements == int(theirs.n_elements), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert ours.data.tobytes() == np.asarray(theirs.data).tobytes(), ours.name
        assert not ours.data.flags.writeable  # a view of the file, not a copy


def test_the_bundled_model_reads_as_gguf_py_reads_it() -> None:
    _assert_same_as_gguf_py(bundled_model_path())
    header = read_gguf(bundled_model_path())
    assert header.version == 3 and len(header.meta["tokenizer.ggml.tokens"]) == 49152


def _write_every_kind(path: Path, alignment: int = 64) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "▁b"])
    w.add_key_value("t.u8s", [1, 2, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [32, 64, 256])
def test_every_value_and_tensor_kind_reads_as_gguf_py_reads_it(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "every.gguf"
    _write_every_kind(path, alignment)
    _assert_same_as_gguf_py(str(path))
    meta = read_gguf(str(path)).meta
    assert meta["t.str"] == "héllo ▁wörld" and meta["t.u64"] == 2**63 + 5
    assert meta["t.bool"] is True and meta["t.strs"] == ["a", "", "▁b"]


def test_a_file_cut_anywhere_or_malformed_is_refused_with_valueerror(tmp_path: Path) -> None:
    path = tmp_path / "every.gguf"
    _write_every_kind(path)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    data_end = max(int(t.data_offset) + int(t.n_bytes) for t in GGUFReader(str(path)).tensors)  # padding follows
    for n in range(data_end):  # inside the header, and inside the tensors' bytes
        cut.write_bytes(whole[:n])
        with pytest.raises(ValueError):
            read_gguf(str(cut))
    assert "runs past the end" in str(pytest.raises(ValueError, read_gguf, str(cut)).value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUG" + whole[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf(str(bad))
    bad.write_bytes(whole[:4] + (3 << 24).to_bytes(4, "little") + whole[8:])  # version 3 written big-endian
    with pytest.raises(ValueError, match="big-endian"):
        read_gguf(str(bad))
    bad.write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="version 1"):
        read_gguf(str(bad))
    nested = b"".join([b"GGUF", (3).to_bytes(4, "little"), (0).to_bytes(8, "little"), (1).to_bytes(8, "little"),
                       (1).to_bytes(8, "little"), b"k", (9).to_bytes(4, "little")])
    nested += ((9).to_bytes(4, "little") + (1).to_bytes(8, "little")) * 100_000  # arrays of arrays of ...
    bad.write_bytes(nested)
    with pytest.raises(ValueError, match="nests arrays too deeply"):
        read_gguf(str(bad))
    for path_ in (cut, bad):
        with pytest.raises(ModelLoadError):
            inspect_model(str(path_))
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(bad))
