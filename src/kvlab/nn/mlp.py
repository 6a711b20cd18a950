"""Feed-forward blocks: SwiGLU (Llama family), GeGLU (Gemma) and the GELU MLP (GPT-2 / nanoGPT)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    At batch 1 every matmul is a matrix-vector product bound by memory bandwidth and by
    per-call overhead; one [2F, D] product instead of two [F, D] ones halves the calls.
    Rows 0..F-1 of `gate_up` are the gate, rows F..2F-1 the up projection.
    """

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)
        return self.down(self.activation(gate) * up)


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP (transformers' `gelu_pytorch_tanh`), same fused layout."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


class GeluMLP(nn.Module):
    """proj(gelu(fc(x))), nanoGPT's MLP."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(dim, hidden, bias=bias)
        self.proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def make_mlp(kind: str, dim: int, hidden: int, bias: bool) -> nn.Module:
    if kind == "swiglu":
        return SwiGLU(dim, hidden, bias)
    if kind == "gelu":
        return GeluMLP(dim, hidden, bias)
    if kind == "geglu":
        return GeGLU(dim, hidden, bias)
    raise ValueError(f"unknown mlp {kind!r}")
