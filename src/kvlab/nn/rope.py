"""Rotary position embeddings (RoPE), in both layouts real checkpoints use.

A head vector is split into pairs of channels; pair i at position p is rotated by the angle
p * base^(-2i/dim). The two layouts differ only in which channels form a pair:
- "half" (GPT-NeoX, Hugging Face Llama): channel i pairs with channel i + dim/2;
- "interleaved" (the RoPE paper, llama2.c, llama.cpp's NORM mode): channel 2i pairs with 2i + 1.
A model trained in one layout runs in the other once its Q/K projection rows are permuted,
which is why GGUF files store Llama's Q/K rows permuted (see kvlab.checkpoints.gguf).

Either way the rotation is x * cos + partner(x) * sin_signed, where partner(x) swaps each
pair and the tables are widened to the full head: three elementwise ops per call, which
matters when a decode step applies RoPE sixty times.
"""

from __future__ import annotations

import torch
from torch import nn

HALF = "half"
INTERLEAVED = "interleaved"
ROPE_STYLES = (HALF, INTERLEAVED)


def rope_angles(dim: int, max_seq_len: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each pair's angle, [max_seq_len, dim // 2], computed in float64 for accuracy."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def rope_tables(dim: int, max_seq_len: int, base: float = 10000.0, style: str = HALF) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos and signed sin [max_seq_len, dim] laid out for `style` (fp32)."""
    cos, sin = rope_angles(dim, max_seq_len, base)
    if style == HALF:
        return torch.cat((cos, cos), -1).float(), torch.cat((-sin, sin), -1).float()
    if style == INTERLEAVED:
        return cos.repeat_interleave(2, -1).float(), torch.stack((-sin, sin), -1).flatten(-2).float()
    raise ValueError(f"unknown RoPE style {style!r}; expected one of {ROPE_STYLES}")


def partner(x: torch.Tensor, style: str) -> torch.Tensor:
    """Each channel's pair partner: (x2, x1) for half layout, (x[2i+1], x[2i]) for interleaved."""
    if style == HALF:
        return x.roll(x.shape[-1] // 2, dims=-1)
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = HALF) -> torch.Tensor:
    """Rotate `x` [..., T, dim] with full-width tables `cos`, `sin` [T, dim] from `rope_tables`."""
    return torch.addcmul(x * cos, partner(x, style), sin)


class RoPE(nn.Module):
    """Precomputed rotary tables for positions 0..max_seq_len-1, applied from an offset.

    The tables are buffers, so they follow `model.to(dtype)`: a bf16 model rotates in bf16,
    exactly as Hugging Face casts its fp32 tables to the activations' dtype.
    """

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0, style: str = HALF):
        super().__init__()
        self.dim, self.max_seq_len, self.base, self.style = dim, max_seq_len, base, style
        cos, sin = rope_tables(dim, max_seq_len, base, style)
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
