"""The GGUF container, read directly: the header, the metadata key/values and the tensor table, and each tensor's
bytes as a view of the memory-mapped file. The `gguf` package's own reader builds a Python object per element of
every array and takes 3 s on SmolLM2's 49,152-token vocabulary; this one reads the same file in ~0.1 s.

Layout (GGUF v2/v3, little-endian): magic "GGUF", uint32 version, uint64 tensor count, uint64 key/value count;
each key/value: string key, uint32 type, value (arrays: uint32 element type, uint64 count, elements); each tensor:
string name, uint32 dims, uint64 sizes (fastest first), uint32 type, uint64 offset into the data section, which
starts at the next multiple of `general.alignment` (default 32) after the table. Strings: uint64 length + UTF-8.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of a scalar; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: its bytes are file[data_start + offset:][:nbytes]."""

    name: str
    shape: tuple[int, ...]    # the GGUF order: fastest-varying dimension first
    type_id: int              # a ggml type (gguf.GGMLQuantizationType)
    offset: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The row-major shape (Hugging Face's [out, in] for a weight)."""
        return tuple(reversed(self.shape))


class GGUFFile:
    """A GGUF file's metadata (`metadata`: key -> int, float, bool, str or list) and tensor table (`tensors`),
    read at construction; tensor bytes are read on demand from a read-only memory map."""

    def __init__(self, path: str | Path) -> None:
        """ValueError naming the file when it is not GGUF, is truncated, or is malformed."""
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot open {self.path}: {error}") from error
        self._buffer, self._pos = memoryview(self._map), len(MAGIC)
        if bytes(self._buffer[:len(MAGIC)]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with {MAGIC!r})")
        try:
            self._read_header()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"{self.path} is not a complete GGUF file: {type(error).__name__}: {error}") from error

    def _read_header(self) -> None:
        version, tensor_count, kv_count = self._scalar("<I"), self._scalar("<Q"), self._scalar("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        self.tensors: list[TensorInfo] = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self._data_start = -(-self._pos // alignment) * alignment
        for info in self.tensors:
            if self._data_start + info.offset + self.nbytes(info) > len(self._map):
                raise ValueError(f"tensor {info.name!r} runs past the end of the file (truncated?)")

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buffer, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        if self._pos + length > len(self._buffer):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self._buffer[self._pos:self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, type_id: int):
        if type_id == _STRING:
            return self._string()
        if type_id == _ARRAY:
            element_type, count = self._scalar("<I"), self._scalar("<Q")
            if element_type in _SCALARS:  # numbers in one read
                fmt = _SCALARS[element_type]
                values = np.frombuffer(self._buffer, dtype=np.dtype(fmt), count=count, offset=self._pos)
                self._pos += values.nbytes
                return values.tolist()
            return [self._value(element_type) for _ in range(count)]
        if type_id not in _SCALARS:
            raise ValueError(f"unknown metadata value type {type_id}")
        return self._scalar(_SCALARS[type_id])

    def _tensor_info(self) -> TensorInfo:
        name = self._string()
        dims = self._scalar("<I")
        shape = tuple(self._scalar("<Q") for _ in range(dims))
        return TensorInfo(name, shape, self._scalar("<I"), self._scalar("<Q"))

    @staticmethod
    def nbytes(info: TensorInfo) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
        return int(np.prod(info.shape, dtype=np.int64)) // block * block_bytes

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 rows [*torch_shape[:-1], row bytes] (what gguf.quants.dequantize takes),
        a view of the file."""
        start = self._data_start + info.offset
        data = np.asarray(self._map[start:start + self.nbytes(info)])  # a plain view: memmap slices cost per call
        rows = int(np.prod(info.torch_shape[:-1], dtype=np.int64))
        return data.reshape(*info.torch_shape[:-1], len(data) // max(rows, 1))
