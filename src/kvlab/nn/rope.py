"""Rotary position embeddings (RoPE), in both layouts real checkpoints use.

A head vector is split into pairs of channels; pair i at position p is rotated by the angle
p * base^(-2i/dim). The two layouts differ only in which channels form a pair:
- "half" (GPT-NeoX, Hugging Face Llama): channel i pairs with channel i + dim/2;
- "interleaved" (the RoPE paper, llama2.c, llama.cpp's NORM mode): channel 2i pairs with 2i + 1.
A model trained in one layout runs in the other once its Q/K projection rows are permuted,
which is why GGUF files store Llama's Q/K rows permuted (see kvlab.checkpoints.gguf).
"""

from __future__ import annotations

import torch
from torch import nn

HALF = "half"
INTERLEAVED = "interleaved"
ROPE_STYLES = (HALF, INTERLEAVED)


def rope_angles(dim: int, max_seq_len: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_seq_len, dim // 2], computed in float64 for accuracy."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = HALF) -> torch.Tensor:
    """Rotate `x` [..., T, dim] by per-position `cos`/`sin` [T, dim // 2]."""
    if style == HALF:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if style == INTERLEAVED:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    raise ValueError(f"unknown RoPE style {style!r}; expected one of {ROPE_STYLES}")


class RoPE(nn.Module):
    """Precomputed rotary tables for positions 0..max_seq_len-1, applied from an offset.

    The tables are buffers, so they follow `model.to(dtype)`: a bf16 model rotates in bf16,
    exactly as Hugging Face casts its fp32 tables to the activations' dtype.
    """

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0, style: str = HALF):
        super().__init__()
        if style not in ROPE_STYLES:
            raise ValueError(f"unknown RoPE style {style!r}; expected one of {ROPE_STYLES}")
        self.dim, self.max_seq_len, self.base, self.style = dim, max_seq_len, base, style
        cos, sin = rope_angles(dim, max_seq_len, base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotate `x` [..., T, dim] as if its tokens sit at positions start..start+T-1."""
        end = start + x.shape[-2]
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} is beyond the model's {self.max_seq_len}-token context")
        return apply_rope(x, self.cos[start:end], self.sin[start:end], self.style)

    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [..., T, dim] at explicit `positions` [T] (the signature kvlab.cache's pre-RoPE caches call)."""
        return apply_rope(x, self.cos[positions], self.sin[positions], self.style)
