"""A GGUF file's header read in one pass: its key/values as Python values, its tensors as views of the mapping.

gguf-py's `GGUFReader` makes a numpy view of its memmap for every element of every array field (some 250,000
for a 49,152-token vocabulary with its scores, types and merges): ~3 s for the bundled model on these hosts,
paid by every process that opens a model (a gateway for its tokenizer, each engine and each rank, `inspect`).
This reads the same layout with `struct` over an `mmap`: ~0.1 s. Each tensor's `data` is the array
`GGUFReader` gives (same dtype and shape: elements for the float and integer types, bytes a row for the block
types), so gguf-py's `dequantize` and our block readers take it unchanged.

The format (GGUF versions 2 and 3, little-endian): magic "GGUF", version u32, tensor count u64, key/value count
u64; each key/value a string key, a u32 type and the value (strings are a u64 length and UTF-8 bytes; arrays an
element type u32, a u64 count and the elements); then each tensor's name, dimension count u32, dimensions u64
(innermost first), type u32 and offset u64 from the data section, which starts at the next multiple of
`general.alignment` (32 when absent).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format of one scalar (8 is a string, 9 an array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types whose data GGUFReader gives as elements rather than as bytes of blocks.
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: innermost (columns) first, as GGUFReader's `shape`
    n_elements: int
    data: np.ndarray  # read-only view of the mapped file: rows first, as GGUFReader's `data`


class GGUFHeader(NamedTuple):
    version: int
    meta: dict[str, Any]  # every key/value, arrays as lists
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values one after another from the mapped bytes; a read past the end raises."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.offset + length
        if end > len(self.buf):
            raise ValueError(f"a string of {length} bytes at offset {self.offset} runs past the end of the file")
        text = self.buf[self.offset : end].decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            if item_kind in _SCALARS:  # numbers: one unpack for the whole array
                fmt = f"<{count}{_SCALARS[item_kind]}"
                items = list(struct.unpack_from(fmt, self.buf, self.offset))
                self.offset += struct.calcsize(fmt)
                return items
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at offset {self.offset - 4}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: str) -> GGUFHeader:
    """The header of the GGUF file at `path`. Raises OSError (unreadable) or ValueError (not a GGUF file this
    reads: bad magic, another version, big-endian, truncated, a tensor outside the file)."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ValueError(f"{path} is empty") from exc
    try:
        return _parse(buf)
    except struct.error as exc:
        raise ValueError(f"{path} ends inside its GGUF header") from exc
    except RecursionError as exc:  # arrays of arrays nested beyond any real file's
        raise ValueError(f"{path} nests arrays too deeply") from exc


def _parse(buf: mmap.mmap) -> GGUFHeader:
    if buf[:4] != MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    cur = _Cursor(buf)
    cur.offset = 4
    version = cur.scalar("I")
    if version & 0xFFFF == 0:
        raise ValueError("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (only {', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
    meta: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.scalar("I")
        dims = tuple(cur.scalar("Q") for _ in range(n_dims))
        infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cur.offset // alignment) * alignment
    whole = np.frombuffer(buf, dtype=np.uint8)  # read-only; keeps the mapping alive as the views' base
    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown type {raw_type}") from None
        if not dims:
            raise ValueError(f"tensor {name} has no dimensions")
        block, type_size = GGML_QUANT_SIZES[kind]
        n_elements = int(np.prod(dims, dtype=np.int64))
        rows_first = tuple(reversed(dims))
        if kind in _ELEMENT_DTYPES:
            dtype, shape = _ELEMENT_DTYPES[kind], rows_first
        else:  # raises ValueError where a row is not whole blocks
            dtype, shape = np.uint8, quant_shape_to_byte_shape(rows_first, kind)
        n_bytes = n_elements * type_size // block
        lo = start + offset
        if lo + n_bytes > len(buf):
            raise ValueError(f"tensor {name} ({n_bytes} bytes at {lo}) runs past the end of the file")
        data = whole[lo : lo + n_bytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, kind, dims, n_elements, data))
    return GGUFHeader(version, meta, tensors)


__all__ = ["GGUFHeader", "GGUFTensor", "read_gguf"]
