"""GGUF block types as the planes kvlab's kernels compute on, without changing a weight.

Every block type below decodes to w = code x scale (+ offset), with small integer codes and
one scale (and offset) per group of 16 or 32 weights, each exactly representable in fp32:

| GGUF type | block | planes kind | code | per group |
|---|---|---|---|---|
| Q4_0 | 32 weights: fp16 d, 16 bytes of nibbles | q4_1 | q in 0..15 | scale d, offset -8 d |
| Q4_1 | 32: fp16 d, fp16 m, nibbles | q4_1 | q | d, m |
| Q4_K | 256: fp16 d, dmin, 12 bytes of 6-bit scales and mins, nibbles | q4_1 | q | d sc_j, -dmin m_j (per 32) |
| Q5_0 | 32: fp16 d, 32 high bits, nibbles | q8_0 | q - 16 | d |
| Q8_0 | 32: fp16 d, 32 int8 | q8_0 | q | d |
| Q6_K | 256: 4-bit low parts, 2-bit high parts, 16 int8 scales, fp16 d | q6_k | q - 32 | d sc_j (per 16) |

The bit layouts follow llama.cpp's ggml-common.h (Q4_K's scale packing is gguf-py's own
`Q4_K.get_scale_min`); a test checks every type's planes decode to exactly what
`gguf.quants.dequantize` gives, bit for bit: the scales are the same fp32 products gguf-py
forms (fp16 d times a 6-bit or int8 factor, exact in fp32), and code x scale is then the
same single rounding.

`planes_from_blocks` gives codes in natural order (one a byte), for `Planes.dense` and the int4
path. The kernels keep "q4_1" codes two to a byte, as Q4_0 and Q4_1 blocks already hold them,
so loading for the kernels goes through `packed_from_blocks` instead: views of the file's
bytes where the layout allows (Q4_0, Q4_1, Q8_0), and `stack_packed` copies each stored
matrix's rows once, in the order asked for, into one set of tensors per fused matrix. A test
checks that route gives GGMLLinear exactly the buffers the Planes route gives, for every type.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch

from kvlab.nn.ggml import GROUP, PackedPlanes, Planes


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp16 values stored as byte pairs in the last axis -> fp32, one per pair."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1)


def planes_from_blocks(raw: np.ndarray, type_name: str, cols: int) -> Optional[Planes]:
    """`raw` uint8 [rows, bytes]: one row of `type_name` blocks per matrix row; None if unsupported."""
    rows = raw.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}[type_name]
        blocks = raw.reshape(rows, cols // 32, size)
        d = _f16(blocks[..., 0:2])
        if type_name == "Q8_0":
            return Planes("q8_0", _t(blocks[..., 2:].view(np.int8), rows), torch.from_numpy(d))
        if type_name == "Q5_0":
            high = (blocks[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
            codes = (_nibbles(blocks[..., 6:]) | (high.astype(np.uint8) << 4)).astype(np.int8) - 16
            return Planes("q8_0", _t(codes, rows), torch.from_numpy(d))
        if type_name == "Q4_0":
            return Planes("q4_1", _t(_nibbles(blocks[..., 2:]), rows), torch.from_numpy(d),
                          torch.from_numpy(-8 * d))
        return Planes("q4_1", _t(_nibbles(blocks[..., 4:]), rows), torch.from_numpy(d),
                      torch.from_numpy(_f16(blocks[..., 2:4])))
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scales = _f16(blocks[:, 0:2])[:, None] * sc.astype(np.float32)
        offsets = -(_f16(blocks[:, 2:4])[:, None] * mins.astype(np.float32))
        # 128 bytes = 4 chunks of 32: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return Planes("q4_1", _t(qs & 0x0F, rows), torch.from_numpy(scales.reshape(rows, -1)),
                      torch.from_numpy(offsets.reshape(rows, -1)))
    if type_name == "Q6_K":
        blocks = raw.reshape(-1, 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
        codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
        scales = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return Planes("q6_k", _t(codes, rows), torch.from_numpy(scales.reshape(rows, -1)))
    return None


def _t(codes: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1))


@dataclass(frozen=True)
class BlockPlanes:
    """One stored matrix in the kernels' layout (`PackedPlanes`) as numpy arrays, not yet copied:
    the codes of Q4_0, Q4_1 and Q8_0 are strided views of the mapped file. `order` picks the
    rows `stack_packed` will write (None: as stored), e.g. llama.cpp's Q/K rows un-permuted."""

    kind: str
    cols: int
    codes: np.ndarray  # [rows, ...]: each row's trailing axes flatten (C order) to its packed codes
    scales: np.ndarray  # fp32 [rows, cols / GROUP[kind]]
    offsets: Optional[np.ndarray] = None  # fp32 like scales, "q4_1" only
    order: Optional[np.ndarray] = None  # row indices, a permutation of range(rows)

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def take_rows(self, order: Optional[np.ndarray]) -> "BlockPlanes":
        return replace(self, order=order)


def packed_from_blocks(raw: np.ndarray, type_name: str, cols: int) -> Optional[BlockPlanes]:
    """`raw` uint8 [rows, bytes] (a view of the file is fine) as kernel-layout planes; None if unsupported.

    The same matrices as `planes_from_blocks(...).packed()`, without materialising natural-order codes.
    """
    rows = raw.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
        blocks = raw.reshape(rows, cols // 32, size)
        d = _f16(blocks[..., 0:2])
        if type_name == "Q8_0":
            return BlockPlanes("q8_0", cols, blocks[..., 2:].view(np.int8), d)
        if type_name == "Q4_0":
            return BlockPlanes("q4_1", cols, blocks[..., 2:], d, -8 * d)
        return BlockPlanes("q4_1", cols, blocks[..., 4:], d, _f16(blocks[..., 2:4]))
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scales = _f16(blocks[:, 0:2])[:, None] * sc.astype(np.float32)
        offsets = -(_f16(blocks[:, 2:4])[:, None] * mins.astype(np.float32))
        # 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, its high nibbles 2c + 1.
        # Packed, sub-block j's byte p holds its weights p (low) and p + 16 (high nibble).
        qs = blocks[:, 16:].reshape(-1, 4, 2, 16)
        first, second = qs[:, :, 0], qs[:, :, 1]  # bytes 32c + p and 32c + 16 + p
        codes = np.stack(((first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)), axis=2)
        return BlockPlanes("q4_1", cols, codes.reshape(rows, -1), scales.reshape(rows, -1), offsets.reshape(rows, -1))
    if type_name in ("Q5_0", "Q6_K"):  # int8 codes either way: the natural planes are the packed ones
        planes = planes_from_blocks(raw, type_name, cols)
        return BlockPlanes(planes.kind, cols, planes.codes.numpy(), planes.scales.numpy())
    return None


def stack_packed(parts: Sequence[BlockPlanes]) -> PackedPlanes:
    """Row-stacked matrices of one kind as one, each part's rows written straight into tensors
    allocated once for the whole stack: no concatenation, no intermediate copies."""
    kind, cols = parts[0].kind, parts[0].cols
    if any(part.kind != kind or part.cols != cols for part in parts):
        raise ValueError("only planes of one kind and width stack")
    rows = sum(part.rows for part in parts)
    codes = torch.empty(rows, cols // 2 if kind == "q4_1" else cols, dtype=torch.uint8 if kind == "q4_1" else torch.int8)
    scales = torch.empty(rows, cols // GROUP[kind])
    offsets = torch.empty(rows, cols // GROUP[kind]) if kind == "q4_1" else None
    start = 0
    for part in parts:
        stop = start + part.rows
        for target, source in ((codes, part.codes), (scales, part.scales), (offsets, part.offsets)):
            if target is None:
                continue
            rows_out = target.numpy()[start:stop].reshape(source.shape)  # a view: rows of a contiguous tensor
            if part.order is None:
                np.copyto(rows_out, source)
            else:
                np.take(source, part.order, axis=0, out=rows_out)
        start = stop
    return PackedPlanes(kind, cols, codes, scales, offsets)
