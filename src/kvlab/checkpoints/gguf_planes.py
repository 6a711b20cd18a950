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
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvlab.nn.ggml import Planes


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
