"""Quantisers the caches share: min-max groups, bit packing, fp8 with a static scale.

Free of any cache logic so the engine (or a benchmark) can reuse them alone. Layouts follow
kvlab.plan.kv_formats, which counts their bytes: codes packed per row into
ceil(dim * bits / 8) uint8 bytes, one fp16 scale and one fp16 zero point per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.plan.kv_formats import groups_per_row, packed_row_bytes

PACKABLE_BITS = (2, 4, 8)  # widths that divide a byte, so codes never straddle two bytes
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def levels(bits: int) -> int:
    """Largest code of a `bits`-bit quantiser (codes run 0..levels)."""
    return (1 << bits) - 1


def quantize_groups(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Quantise the last axis of `x` in groups of `group_size` channels, asymmetric min-max.

    Returns unpacked codes (uint8, like x), scale and zero (fp16, [..., n_groups]) with
    x ~ codes * scale + zero; the last group may be partial. Codes are computed against the
    fp16 scale and zero actually stored, so the error is half a stored step, plus fp16
    rounding of the range's ends.
    """
    _check_bits(bits)
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    dim = x.shape[-1]
    groups = groups_per_row(dim, group_size)
    pad = groups * group_size - dim
    xf = x.float()
    lo = F.pad(xf, (0, pad), value=float("inf")).unflatten(-1, (groups, group_size)).amin(-1)
    hi = F.pad(xf, (0, pad), value=float("-inf")).unflatten(-1, (groups, group_size)).amax(-1)
    scale = ((hi - lo) / levels(bits)).to(torch.float16)
    zero = lo.to(torch.float16)
    step = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant group needs code 0 only
    codes = ((xf - _spread(zero, group_size, dim)) / _spread(step, group_size, dim)).round_()
    return codes.clamp_(0, levels(bits)).to(torch.uint8), scale, zero


def dequantize_groups(codes: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of `quantize_groups`: codes * scale + zero, per group of the last axis."""
    dim = codes.shape[-1]
    return (codes.float() * _spread(scale, group_size, dim) + _spread(zero, group_size, dim)).to(dtype)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack `bits`-bit codes along the last axis into uint8, first code in the lowest bits."""
    _check_bits(bits)
    per_byte = 8 // bits
    dim = codes.shape[-1]
    row = packed_row_bytes(dim, bits)
    slots = F.pad(codes.to(torch.uint8), (0, row * per_byte - dim)).unflatten(-1, (row, per_byte))
    packed = slots[..., 0].clone()
    for j in range(1, per_byte):
        packed |= slots[..., j] << (j * bits)
    return packed


def unpack_codes(packed: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of `pack_codes`: the first `dim` codes of each packed row, as uint8."""
    _check_bits(bits)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & levels(bits)
    return codes.flatten(-2)[..., :dim]


def fp8_quantize(x: Tensor, dtype: torch.dtype, scale: float | Tensor = 1.0) -> Tensor:
    """Store x / scale in an fp8 dtype, saturating at its largest finite value (as vLLM does)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def fp8_dequantize(x8: Tensor, scale: float | Tensor = 1.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """Read fp8 values back as x8 * scale in `dtype`."""
    return (x8.float() * scale).to(dtype)


def fp8_scale(x: Tensor, dtype: torch.dtype, per_head: bool = False) -> float | Tensor:
    """Calibrate a static scale so max|x| maps to the fp8 dtype's largest value.

    Per tensor gives a float; per head (x [B, H, T, D]) a tensor [H]. All-zero input gives 1.
    """
    limit = torch.finfo(dtype).max
    if not per_head:
        amax = float(x.abs().max()) if x.numel() else 0.0
        return amax / limit if amax > 0 else 1.0
    amax = x.abs().float().amax(dim=(0, 2, 3))
    return torch.where(amax > 0, amax / limit, torch.ones_like(amax))


def _spread(per_group: Tensor, group_size: int, dim: int) -> Tensor:
    """Repeat one value per group across its channels, trimming the partial last group."""
    return per_group.float().repeat_interleave(group_size, dim=-1)[..., :dim]


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
