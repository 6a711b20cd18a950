"""Read a GGUF file's header and tensor table with the stdlib, skipping what is not asked for.

`gguf.GGUFReader` builds a numpy view for every metadata item, so SmolLM2's 49k-entry
vocabulary and 49k merges cost seconds before a single shape is known. A header is a short
run of (key, type, value) records followed by one record per tensor; this reader walks it
with `struct` over an mmap, keeps scalars and numeric arrays, and by default leaves string
arrays (the vocabulary) as a `SkippedArray` that records where they lie, so the planner
reads a 100 MB file's shape in milliseconds. The checkpoint loader asks for the strings
(`strings=True`) and gets plain Python lists, still far faster than numpy views per item.

Both the planner (`kvlab.plan.gguf_header`) and the loader (`kvlab.checkpoints.gguf`) read
files through this one parser. The layout follows ggml's gguf.md (versions 2 and 3,
little-endian); a malformed or truncated file raises a one-line `PlanError`.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from dataclasses import dataclass
from typing import Any, Union

from kvlab.plan.errors import PlanError

MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF value type -> struct format of one item (8: string, 9: array handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml tensor type id -> (name, weights per block, bytes per block); ggml.h / gguf-py's GGML_QUANT_SIZES
TENSOR_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


@dataclass(frozen=True)
class SkippedArray:
    """A string array left unread: its length is known (a vocabulary's size), its items are not."""

    count: int
    offset: int  # where its first item starts in the file

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-table record: GGUF lists dims innermost first (a [rows, cols] matrix is (cols, rows))."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.type_id][0]

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.dims:
            count *= dim
        return count

    @property
    def n_bytes(self) -> int:
        _, block, size = TENSOR_TYPES[self.type_id]
        return self.n_elements // block * size

    @property
    def rows_first_shape(self) -> tuple[int, ...]:
        """The shape numpy and torch use (outermost first)."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    """Metadata and tensor table of one file; tensor data stays on disk."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int

    @property
    def weight_bytes(self) -> int:
        return sum(tensor.n_bytes for tensor in self.tensors.values())


def read_gguf_header(path: Union[str, os.PathLike], strings: bool = False) -> GGUFHeader:
    """Parse `path`'s header; `strings=False` leaves string arrays as `SkippedArray`s."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PlanError(f"no GGUF file at {path}")
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:
                raise PlanError(f"{path} is not a readable GGUF file (only {size} bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return _Parser(view, path, strings).header(size)
    except OSError as error:
        raise PlanError(f"cannot read {path}: {error.strerror or error}") from None


class _Parser:
    """A cursor over the mapped bytes; every read past the end is a truncated file."""

    def __init__(self, view: mmap.mmap, path: str, strings: bool) -> None:
        self.view, self.path, self.strings, self.at = view, path, strings, 0

    def header(self, size: int) -> GGUFHeader:
        if self.view[:4] != MAGIC:
            raise PlanError(f"{self.path} is not a readable GGUF file (it does not start with 'GGUF')")
        self.at = 4
        version = self.scalar("I")
        if version not in (2, 3):
            raise PlanError(f"{self.path}: GGUF version {version} is not supported (kvlab reads 2 and 3)")
        tensor_count, kv_count = self.scalar("Q"), self.scalar("Q")
        if tensor_count > size or kv_count > size:
            raise PlanError(f"{self.path}: is truncated or corrupt: its header counts {tensor_count} tensors and {kv_count} keys")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self.string()
            metadata[key] = self.value(self.scalar("I"))
        records = [self.tensor_record() for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise PlanError(f"{self.path}: general.alignment must be a power of two, got {alignment!r}")
        data = -(-self.at // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, relative in records:
            if name in tensors:
                raise PlanError(f"{self.path}: tensor {name} is listed twice")
            tensor = TensorInfo(name, dims, type_id, data + relative)
            if tensor.offset + tensor.n_bytes > size:
                raise PlanError(f"{self.path} is truncated: tensor {name} runs past the end of the file")
            tensors[name] = tensor
        return GGUFHeader(self.path, version, metadata, tensors, data, size)

    def take(self, count: int) -> bytes:
        end = self.at + count
        if count < 0 or end > len(self.view):
            raise PlanError(f"{self.path} is truncated or corrupt: its header runs past the end of the file")
        chunk = self.view[self.at:end]
        self.at = end
        return chunk

    def scalar(self, code: str) -> Any:
        width = struct.calcsize("<" + code)
        return struct.unpack("<" + code, self.take(width))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")  # a vocabulary may hold half a character

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array(self.scalar("I"), self.scalar("Q"))
        raise PlanError(f"{self.path}: unknown GGUF value type {kind} (corrupt header?)")

    def array(self, kind: int, count: int) -> Any:
        if kind in _SCALARS:
            code = _SCALARS[kind]
            raw = self.take(count * struct.calcsize("<" + code))
            if code == "?":
                return [bool(b) for b in raw]
            items = array(code)
            if items.itemsize != struct.calcsize("<" + code):  # a platform whose C sizes differ
                return list(struct.unpack(f"<{count}{code}", raw))
            items.frombytes(raw)
            return items.tolist()
        if kind == STRING:
            start, end, view, length = self.at, len(self.view), self.view, _U64.unpack_from
            at, items = start, []
            for _ in range(count):  # local names: this loop runs once per vocabulary entry
                if at + 8 > end:
                    self._past_end()
                size = length(view, at)[0]
                at += 8
                if self.strings:
                    items.append(str(view[at:at + size], "utf-8", "replace"))
                at += size
            if at > end:
                self._past_end()
            self.at = at
            if self.strings:
                return items
            return SkippedArray(count, start)
        if kind == ARRAY:
            return [self.array(self.scalar("I"), self.scalar("Q")) for _ in range(count)]
        raise PlanError(f"{self.path}: unknown GGUF array item type {kind} (corrupt header?)")

    def tensor_record(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        n_dims = self.scalar("I")
        if n_dims > 8:
            raise PlanError(f"{self.path}: tensor {name} has {n_dims} dimensions (corrupt header?)")
        dims = tuple(self.scalar("Q") for _ in range(n_dims))
        type_id = self.scalar("I")
        if type_id not in TENSOR_TYPES:
            raise PlanError(f"{self.path}: tensor {name} has unknown ggml type {type_id}")
        offset = self.scalar("Q")
        block = TENSOR_TYPES[type_id][1]
        if dims and dims[0] % block:
            raise PlanError(f"{self.path}: tensor {name}'s rows ({dims[0]}) are not whole {block}-weight blocks")
        return name, dims, type_id, offset

    def _past_end(self) -> int:
        raise PlanError(f"{self.path} is truncated or corrupt: its header runs past the end of the file")
