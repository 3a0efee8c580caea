"""A GGUF file's header read in one pass: its key/value metadata as plain Python values and
where each tensor's bytes lie (memory-mapped, not read until used).

``gguf.GGUFReader`` makes a numpy view for every part of every value, so the 49,152
vocabulary strings and 48,900 merges of SmolLM2's GGUF took it 2.2 s on a 2-core machine,
in the server process and again in each worker process; this reads the same header in
about 0.1 s. The tensor types and the dequantisers stay the ``gguf`` package's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {  # little-endian, as every GGUF file llama.cpp writes
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "<?",
}

_PLAIN_TENSORS = {  # element types stored as numbers; the others are blocks of bytes
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGML's ne: the innermost dimension first
    data: np.ndarray  # numbers in the reversed shape, or uint8 blocks (as gguf.quants.dequantize takes)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads the header's little-endian values from the start of the mapped file."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.offset = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self.offset
        self.offset += length
        return bytes(self.view[start:self.offset]).decode("utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if item == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if item == GGUFValueType.ARRAY:
                return [self.value(item) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        dtype = np.dtype(_SCALARS[kind])
        value = np.frombuffer(self.buffer, dtype, 1, self.offset)[0].item()
        self.offset += dtype.itemsize
        return value


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The header of the GGUF file at ``path`` (versions 2 and 3, little-endian)."""
    path = Path(path)
    buffer = np.memmap(path, mode="r")
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    cursor = _Cursor(buffer)
    cursor.offset = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are, little-endian)")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(GGUFValueType(cursor.unpack("<I")))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        infos.append((name, GGMLQuantizationType(cursor.unpack("<I")), dims, cursor.unpack("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in infos:
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if kind in _PLAIN_TENSORS:
            data = np.frombuffer(buffer, _PLAIN_TENSORS[kind], elements, data_start + offset).reshape(shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            data = np.frombuffer(buffer, np.uint8, elements // block * block_bytes, data_start + offset)
            data = data.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, dims, data))
    return GGUFFile(path, version, metadata, tensors)
