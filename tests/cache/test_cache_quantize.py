"""The shared quantisers: bit packing, min-max groups, fp8 with a static scale."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cache_helpers import half_step_bound
from kvlab.cache.quantize import (dequantize_groups, fp8_dequantize, fp8_quantize, fp8_scale, pack_codes,
                                  quantize_groups, unpack_codes)
from kvlab.plan.kv_formats import packed_row_bytes


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), dim=st.integers(1, 70), rows=st.integers(1, 4))
def test_pack_unpack_round_trip(bits: int, dim: int, rows: int) -> None:
    codes = torch.randint(0, 1 << bits, (rows, dim), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, packed_row_bytes(dim, bits))
    assert torch.equal(unpack_codes(packed, bits, dim), codes)


def test_packing_really_packs_low_bits_first() -> None:
    """Two int4 or four int2 codes per byte, the first code in the lowest bits."""
    assert pack_codes(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_codes(torch.tensor([1, 2, 3, 0, 2], dtype=torch.uint8), 2).tolist() == [0b00111001, 0b10]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size,dim", [(32, 64), (16, 40), (64, 20)])
def test_group_error_within_half_a_step(bits: int, group_size: int, dim: int) -> None:
    x = torch.randn(3, 5, dim) * torch.linspace(0.1, 10, dim)
    codes, scale, zero = quantize_groups(x, bits, group_size)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape[-1] == -(-dim // group_size)
    error = (dequantize_groups(codes, scale, zero, group_size) - x).abs()
    assert (error <= half_step_bound(x, bits, group_size)).all()


def test_constant_group_is_exact_up_to_fp16() -> None:
    x = torch.full((2, 8), 0.75)
    codes, scale, zero = quantize_groups(x, 4, 4)
    assert torch.equal(dequantize_groups(codes, scale, zero, 4), x)


@pytest.mark.parametrize("dtype,rel", [(torch.float8_e4m3fn, 2.0 ** -4), (torch.float8_e5m2, 2.0 ** -3)])
def test_fp8_round_trip_relative_error(dtype: torch.dtype, rel: float) -> None:
    """Half an ulp of the mantissa (3 bits e4m3, 2 bits e5m2) once the scale maps max|x| to fp8's max."""
    x = torch.randn(2, 4, 16, 32) * 30
    scale = fp8_scale(x, dtype)
    x8 = fp8_quantize(x, dtype, scale)
    assert x8.dtype == dtype and x8.element_size() == 1
    tiny = scale * torch.finfo(dtype).smallest_normal
    assert ((fp8_dequantize(x8, scale) - x).abs() <= rel * x.abs() + tiny).all()


def test_fp8_saturates_instead_of_overflowing() -> None:
    x8 = fp8_quantize(torch.tensor([1e6, -1e6]), torch.float8_e4m3fn)
    assert fp8_dequantize(x8).tolist() == [448.0, -448.0]
