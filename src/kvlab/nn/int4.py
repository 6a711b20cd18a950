"""A linear layer whose weights stay 4-bit: llama.cpp's Q4_0/Q4_1 blocks, unpacked exactly once.

At batch 1 a decode step reads every weight once, so bytes read bound its speed. A Q4_1
GGUF already holds each weight as a 4-bit code q with a per-32-weight scale d and offset m
(w = q d + m). PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, the one gpt-fast's
int4 path uses) computes with w = (q - 8) * scale + zero per group, so the file's codes map
onto it with scale = d and zero = m + 8 d: no re-quantisation, only the scales rounded to
the compute dtype (bf16). On this project's 2-core CPU it runs SmolLM2's 30 layers of
matrix-vector products in 8.7 ms on two idle cores (16 ms on one) against 27 ms in fp32.
kvlab's own GGML kernels (kvlab.nn.ggml) are faster still; this is the fallback where they
cannot be built.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_DTYPES = (torch.bfloat16, torch.float16)


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Shapes the packing routine accepts."""
    return out_features % 16 == 0 and in_features % group_size == 0 and group_size in (32, 64, 128, 256)


class Int4Linear(nn.Module):
    """y = x W^T with W [out, in] stored as packed 4-bit codes and per-group scale/zero."""

    packing = "int4"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 dtype: torch.dtype = torch.bfloat16):
        """codes [out, in] in 0..15; scale, zero [out, in // group_size]; w = (q - 8) * scale + zero."""
        super().__init__()
        if dtype not in INT4_DTYPES:
            raise ValueError(f"the CPU int4 kernel computes in bf16 or fp16, not {dtype}")
        self.out_features, self.in_features = codes.shape
        if not int4_supported(self.out_features, self.in_features, group_size):
            raise ValueError(f"the CPU int4 kernel needs out % 16 == 0 and in % group == 0, got "
                             f"[{self.out_features}, {self.in_features}] in groups of {group_size}")
        self.group_size = group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        # The kernel wants [in // group, out, 2] with (scale, zero) innermost.
        self.register_buffer("scales_zeros", torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous())

    @classmethod
    def from_offset_codes(cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                          dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """Q4_1's convention, w = q * scale + offset."""
        return cls(codes, scale, offset + 8 * scale, group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Computes in the scales' dtype and answers in x's, so the model around it may stay fp32."""
        flat = x.reshape(-1, self.in_features).to(self.scales_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_zeros)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dense [out, in] weights this layer computes with (for export and inspection)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return self.forward(eye).t().contiguous()

    def _apply(self, fn, recurse=True):
        # model.to(torch.float32) must not widen the scales: the kernel computes in bf16/fp16 only.
        # Device moves still apply (the dtype is restored after).
        dtype = self.scales_zeros.dtype
        super()._apply(fn, recurse)
        self.scales_zeros = self.scales_zeros.to(dtype)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
