"""KIVI (Liu et al., 2024): 2/4-bit keys per channel, values per token, newest tokens exact.

Keys have outlier channels (a few channels far larger than the rest, the same ones at every
token), so KIVI quantises keys per channel over groups of G tokens: each channel gets its own
range. Values have no such structure and feed a per-token weighted sum, so they are
quantised per token in groups of G channels. Per-channel groups need G whole tokens, so the
newest tokens wait in a full-precision residual (compute dtype): when it reaches R + G
tokens, the oldest G are quantised. A sequence of T tokens then holds
kivi_quantised_tokens(T, G, R) = max(0, (T - R) // G) * G quantised tokens, and
kvlab.plan.kv_formats counts exactly the tensors below.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope
from kvlab.cache.quantize import dequantize_groups, pack_codes, quantize_groups, unpack_codes
from kvlab.plan.kv_formats import KIVI, KVFormat, groups_per_row, kivi_quantised_tokens, packed_row_bytes


class _KiviLayer:
    """One layer's tensors; token axis is dim 2 everywhere, all start empty."""

    def __init__(self, shape: KVShape, bits: int, group: int, dtype: torch.dtype, device: torch.device) -> None:
        b, h, dk, dv = shape.batch, shape.kv_heads, shape.k_head_dim, shape.v_head_dim

        def empty(width: int, dt: torch.dtype) -> Tensor:
            return torch.empty(b, h, 0, width, dtype=dt, device=device)

        self.k_codes = empty(packed_row_bytes(dk, bits), torch.uint8)   # [B, H, Tq, row bytes]
        self.k_scale = empty(dk, torch.float16)                          # [B, H, Tq / G, Dk]
        self.k_zero = empty(dk, torch.float16)
        self.v_codes = empty(packed_row_bytes(dv, bits), torch.uint8)   # [B, H, Tq, row bytes]
        self.v_scale = empty(groups_per_row(dv, group), torch.float16)   # [B, H, Tq, Dv / G]
        self.v_zero = empty(groups_per_row(dv, group), torch.float16)
        self.k_residual = empty(dk, dtype)                               # [B, H, Tr, Dk]
        self.v_residual = empty(dv, dtype)

    def tensors(self) -> list[Tensor]:
        return [self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                self.k_residual, self.v_residual]


class KiviCache(KVCache):
    """KIVI-2/4 storage; `fmt` comes from kvlab.plan (bits, group G, residual R)."""

    def __init__(self, shape: KVShape, fmt: KVFormat, compute_dtype: torch.dtype = torch.float32,
                 pre_rope: bool = False, rope: Optional[Rope] = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(shape, compute_dtype, pre_rope, rope, device)
        if fmt.scheme != KIVI:
            raise CacheError(f"KiviCache needs a KIVI format, got {fmt.name}")
        if fmt.residual % fmt.group_size:
            raise CacheError(f"KIVI residual {fmt.residual} must be a multiple of the group size {fmt.group_size}")
        self.kv_format = fmt
        self.bits, self.group, self.residual = fmt.bits, fmt.group_size, fmt.residual
        self._clear()

    def quantised_tokens(self, layer_idx: int = 0) -> int:
        return self.layers[self._layer(layer_idx)].k_codes.shape[2]

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        s = self.layers[layer]
        s.k_residual = torch.cat([s.k_residual, k.to(self.compute_dtype)], dim=2)
        s.v_residual = torch.cat([s.v_residual, v.to(self.compute_dtype)], dim=2)
        # Whole groups beyond the window: the plan's own formula, applied to the residual.
        ready = kivi_quantised_tokens(s.k_residual.shape[2], self.group, self.residual)
        if ready:
            self._quantise_oldest(s, ready)

    def _quantise_oldest(self, s: _KiviLayer, n: int) -> None:
        """Move the oldest `n` residual tokens (whole groups of G) into quantised storage."""
        old_k, old_v = s.k_residual[:, :, :n], s.v_residual[:, :, :n]
        # clone, not a view: a view would keep the whole old residual alive behind a smaller nbytes
        s.k_residual, s.v_residual = s.k_residual[:, :, n:].clone(), s.v_residual[:, :, n:].clone()
        # Keys per channel: transpose so the G tokens of each group lie along the last axis.
        codes, scale, zero = quantize_groups(old_k.transpose(2, 3), self.bits, self.group)
        s.k_codes = torch.cat([s.k_codes, pack_codes(codes.transpose(2, 3), self.bits)], dim=2)
        s.k_scale = torch.cat([s.k_scale, scale.transpose(2, 3)], dim=2)
        s.k_zero = torch.cat([s.k_zero, zero.transpose(2, 3)], dim=2)
        # Values per token, groups of G channels.
        codes, scale, zero = quantize_groups(old_v, self.bits, self.group)
        s.v_codes = torch.cat([s.v_codes, pack_codes(codes, self.bits)], dim=2)
        s.v_scale = torch.cat([s.v_scale, scale], dim=2)
        s.v_zero = torch.cat([s.v_zero, zero], dim=2)

    def _load(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        s = self.layers[layer]
        k_codes = unpack_codes(s.k_codes, self.bits, self.shape.k_head_dim).transpose(2, 3)
        keys = dequantize_groups(k_codes, s.k_scale.transpose(2, 3), s.k_zero.transpose(2, 3), self.group,
                                 self.compute_dtype).transpose(2, 3)
        v_codes = unpack_codes(s.v_codes, self.bits, self.shape.v_head_dim)
        values = dequantize_groups(v_codes, s.v_scale, s.v_zero, self.group, self.compute_dtype)
        return torch.cat([keys, s.k_residual], dim=2), torch.cat([values, s.v_residual], dim=2)

    def tensors(self) -> Iterator[Tensor]:
        return (t for layer in self.layers for t in layer.tensors())

    def _clear(self) -> None:
        self.layers = [_KiviLayer(self.shape, self.bits, self.group, self.compute_dtype, self.device)
                       for _ in range(self.num_layers)]
