"""Codes of any width from 1 to 8 bits packed densely into bytes (3-bit codes straddle bytes).

Code j of a row occupies bits j*b .. j*b+b-1 of the row's bit stream, lowest bit first, and
byte k holds stream bits 8k .. 8k+7: a row of `dim` codes is ceil(dim * b / 8) bytes, as
kvlab.plan.kv_formats.packed_row_bytes counts. For b = 2, 4, 8 this is quantize.pack_codes'
layout too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.plan.kv_formats import packed_row_bytes


def _check(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """codes [..., dim] (values < 2**bits) -> uint8 [..., ceil(dim * bits / 8)]."""
    _check(bits)
    dim = codes.shape[-1]
    row = packed_row_bytes(dim, bits)
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., dim * bits]
    stream = F.pad(stream, (0, row * 8 - dim * bits)).unflatten(-1, (row, 8))
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.int32)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of `pack_bits`: the first `dim` codes of each row, as int64 (ready for indexing)."""
    _check(bits)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1).flatten(-2)
    stream = stream[..., :dim * bits].unflatten(-1, (dim, bits))
    weights = (1 << torch.arange(bits, device=packed.device)).to(torch.int32)
    return (stream * weights).sum(-1).long()
