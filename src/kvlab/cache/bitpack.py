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
    """codes [..., dim] (values < 2**bits) -> uint8 [..., ceil(dim * bits / 8)].

    Eight codes fill exactly `bits` bytes, so each group of eight is one integer of 8 * bits bits,
    written out byte by byte: a few operations per group, not one per bit."""
    _check(bits)
    dim = codes.shape[-1]
    groups = -(-dim // 8)
    code_shifts = bits * torch.arange(8, device=codes.device)
    word = (F.pad(codes.long(), (0, groups * 8 - dim)).unflatten(-1, (groups, 8)) << code_shifts).sum(-1)
    byte_shifts = 8 * torch.arange(bits, device=codes.device)
    packed = ((word.unsqueeze(-1) >> byte_shifts) & 255).flatten(-2)  # [..., groups * bits]
    return packed[..., :packed_row_bytes(dim, bits)].to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of `pack_bits`: the first `dim` codes of each row, as int64 (ready for indexing)."""
    _check(bits)
    groups = -(-dim // 8)
    byte_shifts = 8 * torch.arange(bits, device=packed.device)
    word = (F.pad(packed.long(), (0, groups * bits - packed.shape[-1])).unflatten(-1, (groups, bits))
            << byte_shifts).sum(-1)
    code_shifts = bits * torch.arange(8, device=packed.device)
    return ((word.unsqueeze(-1) >> code_shifts) & ((1 << bits) - 1)).flatten(-2)[..., :dim]
