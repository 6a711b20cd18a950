"""A head's RoPE channel pairs as complex numbers: the algebra both aligned conversions share.

RoPE rotates channel pair f of every head by the same angle p * w_f at position p. Written as
one complex number per pair (first channel + i * partner), the rotation is multiplication by
exp(i p w_f), and a query-key score is sum_f Re(conj(q_f) k_f exp(i w_f (s - p))). So any map
that acts on pair f by a complex number (a 2x2 rotation with a scale), or mixes the pairs of
several heads at the same f by complex weights, commutes with RoPE: that is what lets keys
be merged (kvlab.checkpoints.align) or concentrated into one RoPE key (kvlab.checkpoints.mla_aware)
without touching positions. Rows of a projection [heads, d, in] become complex rows
[heads, d/2, in] and back.
"""

from __future__ import annotations

import torch

from kvlab.nn.rope import HALF


def pair_channels(head_dim: int, style: str) -> tuple[list[int], list[int]]:
    """(first, partner) channel of each of the head_dim/2 pairs, pair f rotating at base**(-2f/head_dim)."""
    half = head_dim // 2
    if style == HALF:
        return list(range(half)), list(range(half, head_dim))
    return list(range(0, head_dim, 2)), list(range(1, head_dim, 2))


def to_complex(rows: torch.Tensor, style: str) -> torch.Tensor:
    """Real rows [..., d, in] -> complex rows [..., d/2, in] (pair f = first + i * partner)."""
    first, partner = pair_channels(rows.shape[-2], style)
    return torch.complex(rows[..., first, :], rows[..., partner, :])


def to_real(rows: torch.Tensor, style: str) -> torch.Tensor:
    """The inverse of `to_complex`: complex rows [..., d/2, in] -> real rows [..., d, in] in `style`."""
    head_dim = 2 * rows.shape[-2]
    first, partner = pair_channels(head_dim, style)
    out = torch.empty(*rows.shape[:-2], head_dim, rows.shape[-1], dtype=rows.real.dtype)
    out[..., first, :], out[..., partner, :] = rows.real, rows.imag
    return out


def pair_energy(rows: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """E|row . x|^2 for complex rows [..., in] and the inputs' second moment sigma = E[x x^T]."""
    sigma = sigma.to(rows.dtype)
    return torch.einsum("...a,ab,...b->...", rows, sigma, rows.conj()).real


def psd_power(matrix: torch.Tensor, power: float, floor: float = 1e-12) -> torch.Tensor:
    """A symmetric PSD matrix to `power` (+-1/2), eigenvalues below floor x the largest treated as
    that floor for positive powers and as zero for negative ones (a pseudo-inverse root)."""
    values, vectors = torch.linalg.eigh(matrix)
    top = values.max().clamp_min(torch.finfo(values.dtype).tiny)
    kept = values > floor * top
    scaled = torch.where(kept, values.clamp_min(floor * top) ** power, torch.zeros_like(values))
    return (vectors * scaled) @ vectors.T
