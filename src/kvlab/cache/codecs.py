"""Per-token row codecs: how one side (K or V) of a cache turns [..., T, D] into stored fields.

Every field a codec produces is [..., T, width]: one row per token. That is what lets one
storage scheme (preallocated, growing, paged blocks) serve every per-token format, and makes
the bytes exactly kvlab.plan's: float and fp8 hold D values per token, group formats hold
ceil(D * bits / 8) code bytes plus an fp16 scale and zero point per group. KIVI's keys group
along tokens, so KIVI is not a row codec (see kivi.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from kvlab.cache.base import TORCH_DTYPES, CacheError
from kvlab.cache.quantize import FP8_DTYPES, dequantize_groups, fp8_dequantize, fp8_quantize, pack_codes, \
    quantize_groups, unpack_codes
from kvlab.plan.kv_formats import FLOAT, GROUP, KVFormat, groups_per_row, packed_row_bytes

FLOAT_DTYPES = TORCH_DTYPES  # the float formats are the model dtypes, stored as they are
Fields = dict[str, Tensor]
Scale = float | Sequence[float] | Tensor


class RowCodec:
    """Encodes rows of `dim` channels into named fields and back; holds no per-token state."""

    dim: int

    def fields(self) -> dict[str, tuple[int, torch.dtype]]:
        """Each stored field's width (elements per token row) and dtype."""
        raise NotImplementedError

    def encode(self, x: Tensor) -> Fields:
        raise NotImplementedError

    def decode(self, fields: Fields, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError


class FloatCodec(RowCodec):
    """Plain storage in fp32/fp16/bf16."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        self.dim = dim
        self.dtype = dtype

    def fields(self) -> dict[str, tuple[int, torch.dtype]]:
        return {"x": (self.dim, self.dtype)}

    def encode(self, x: Tensor) -> Fields:
        return {"x": x.to(self.dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> Tensor:
        return fields["x"].to(dtype)


class Fp8Codec(RowCodec):
    """fp8 values x / scale with a static scale kept outside the cache (per tensor or per head).

    The scale is a calibration constant of the layer, as in vLLM, so the plan counts fp8 as
    exactly one byte per element. A per-head scale is a tensor [H] for rows [B, H, T, D].
    """

    def __init__(self, dim: int, dtype: torch.dtype, scale: Scale = 1.0) -> None:
        self.dim = dim
        self.dtype = dtype
        if isinstance(scale, (int, float)):
            self.scale: float | Tensor = float(scale)
        else:
            self.scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1, 1)
        if float(torch.as_tensor(self.scale).min()) <= 0:
            raise CacheError(f"fp8 scales must be positive, got {scale!r}")

    def fields(self) -> dict[str, tuple[int, torch.dtype]]:
        return {"x": (self.dim, self.dtype)}

    def encode(self, x: Tensor) -> Fields:
        return {"x": fp8_quantize(x, self.dtype, self._scale_on(x.device))}

    def decode(self, fields: Fields, dtype: torch.dtype) -> Tensor:
        x8 = fields["x"]
        return fp8_dequantize(x8, self._scale_on(x8.device), dtype)

    def _scale_on(self, device: torch.device) -> float | Tensor:
        return self.scale if isinstance(self.scale, float) else self.scale.to(device)


class GroupCodec(RowCodec):
    """Per-token groups of `group_size` channels, min-max, codes packed `8 // bits` per byte."""

    def __init__(self, dim: int, bits: int, group_size: int) -> None:
        self.dim = dim
        self.bits = bits
        self.group_size = group_size

    def fields(self) -> dict[str, tuple[int, torch.dtype]]:
        groups = groups_per_row(self.dim, self.group_size)
        return {"codes": (packed_row_bytes(self.dim, self.bits), torch.uint8),
                "scale": (groups, torch.float16), "zero": (groups, torch.float16)}

    def encode(self, x: Tensor) -> Fields:
        codes, scale, zero = quantize_groups(x, self.bits, self.group_size)
        return {"codes": pack_codes(codes, self.bits), "scale": scale, "zero": zero}

    def decode(self, fields: Fields, dtype: torch.dtype) -> Tensor:
        codes = unpack_codes(fields["codes"], self.bits, self.dim)
        return dequantize_groups(codes, fields["scale"], fields["zero"], self.group_size, dtype)


def make_codec(fmt: KVFormat, dim: int, scale: Scale = 1.0) -> RowCodec:
    """The row codec for a plan format and rows of `dim` channels; `scale` matters only for fp8."""
    if fmt.scheme == FLOAT and fmt.name in FP8_DTYPES:
        return Fp8Codec(dim, FP8_DTYPES[fmt.name], scale)
    if fmt.scheme == FLOAT:
        return FloatCodec(dim, FLOAT_DTYPES[fmt.name])
    if fmt.scheme == GROUP:
        return GroupCodec(dim, fmt.bits, fmt.group_size)
    raise CacheError(f"{fmt.name} does not store per-token rows; use the KIVI cache")
