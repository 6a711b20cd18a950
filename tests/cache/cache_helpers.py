"""Helpers for the cache tests: a reference RoPE, the plan's byte figures, error bounds, attention.

A uniquely named module (not conftest) so `from cache_helpers import ...` cannot pick up
another directory's conftest.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.plan.spec import ModelSpec, uniform_layers


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE (Llama layout): channel i pairs with i + D/2, pair j turns at base^(-j/(D/2))."""
    half = x.shape[-1] // 2
    angles = positions[:, None].double() * base ** (-torch.arange(half, dtype=torch.float64) / half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def plan_nbytes(kv_cache_dtype: str, tokens: int, batch: int, layers: int, kv_heads: int, k_dim: int, v_dim: int,
                model_dtype: str = "fp32", group_size: Optional[int] = None, residual: Optional[int] = None) -> int:
    """The planner's bytes for `batch` sequences of `tokens` tokens: what a cache must hold."""
    spec = ModelSpec("cache-test", uniform_layers(layers, kv_heads, kv_heads, k_dim, v_dim))
    formats = cache_formats(kv_cache_dtype, model_dtype=model_dtype, group_size=group_size, residual=residual)
    return batch * kv_bytes_per_sequence(spec, tokens, formats)


def half_step_bound(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Per-element error allowed for min-max quantisation of x's last axis in groups.

    Half a step, (max - min) / (2^bits - 1) / 2, plus fp16 rounding of the stored scale and
    zero point (relative 2^-11, doubled for slack), computed from the data, not the cache.
    """
    dim = x.shape[-1]
    groups = math.ceil(dim / group_size)
    pad = groups * group_size - dim
    lo = F.pad(x, (0, pad), value=math.inf).unflatten(-1, (groups, group_size)).amin(-1)
    hi = F.pad(x, (0, pad), value=-math.inf).unflatten(-1, (groups, group_size)).amax(-1)
    spread = hi - lo
    bound = spread / ((1 << bits) - 1) / 2 + 2.0 ** -10 * (lo.abs() + spread) + 1e-6
    return bound.repeat_interleave(group_size, dim=-1)[..., :dim]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention for queries at positions start.. over keys 0..: the decode-time mask."""
    n, total = q.shape[2], k.shape[2]
    mask = torch.arange(total)[None, :] <= (start + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class PoolRows:
    """The engine's pool (kvlab.cache.KVPool) behind the lab caches' `update`, so the recompute
    harnesses hold it to the same standard: row r of the batch owns shuffled blocks of its own."""

    def __init__(self, kv_cache_dtype: str, layers: int, batch: int, kv_heads: int, dim: int, max_tokens: int,
                 block_size: int, group_size=None, residual=None, compute_dtype=torch.float32, seed: int = 0):
        from kvlab.cache.pool import KVPool
        from kvlab.plan.kv_formats import resolve_kv_format

        per_row = -(-max_tokens // block_size)
        fmt = resolve_kv_format(kv_cache_dtype, {torch.float32: "fp32", torch.bfloat16: "bf16",
                                                 torch.float16: "fp16"}[compute_dtype], group_size, residual)
        self.pool = KVPool(layers, kv_heads, dim, dim, batch * per_row + 3, block_size, fmt, compute_dtype,
                           seats=batch)
        order = torch.randperm(self.pool.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = [order[r * per_row:(r + 1) * per_row] for r in range(batch)]
        self.lengths = [0] * layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        from kvlab.cache.step import StepBatch

        batch, _, new, _ = k.shape
        start = self.lengths[layer]
        step = StepBatch.build([start] * batch, [new] * batch, self.tables, self.pool.block_size,
                               seats=list(range(batch)))
        rows = lambda x: x.transpose(1, 2).reshape(batch * new, x.shape[1], x.shape[3])  # noqa: E731
        self.pool.store(layer, rows(k), rows(v), step)
        self.lengths[layer] = start + new
        read = [self.pool.attention_inputs(layer, step, s)[:2] for s in range(batch)]
        return torch.stack([keys for keys, _ in read]), torch.stack([values for _, values in read])
