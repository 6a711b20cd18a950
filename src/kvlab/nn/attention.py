"""Grouped-query attention: one module for MHA (n_kv == n_q), GQA and MQA (n_kv == 1).

Query head h reads KV head h // (n_q / n_kv). The fast path hands the un-repeated K/V to
PyTorch's scaled_dot_product_attention with `enable_gqa=True`, so no repeated copy of the
cache is built; `tests/nn/test_attention.py` checks it against an explicit repeat_interleave.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from kvlab.cache.step import StepBatch
from kvlab.nn.config import ModelConfig
from kvlab.nn.norms import RMSNorm
from kvlab.nn.rope import RoPE


def causal_mask(new_tokens: int, total_tokens: int, device: torch.device) -> torch.Tensor:
    """Boolean [new, total] mask: the new tokens sit at the end, each sees itself and the past."""
    past = total_tokens - new_tokens
    rows = torch.arange(new_tokens, device=device)[:, None] + past
    return torch.arange(total_tokens, device=device)[None, :] <= rows


def sliding_mask(new_tokens: int, total_tokens: int, window: int, device: torch.device) -> Optional[torch.Tensor]:
    """`causal_mask` that also hides keys `window` or more positions back (Gemma's sliding layers:
    each query sees itself and the window - 1 keys before it); None when nothing is that far back,
    leaving `attend` its causal default."""
    if total_tokens <= window:
        return None
    past = total_tokens - new_tokens
    rows = torch.arange(new_tokens, device=device)[:, None] + past
    keys = torch.arange(total_tokens, device=device)[None, :]
    return (keys <= rows) & (keys > rows - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
           mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of q [B,Hq,Tq,D] over k/v [B,Hkv,Tk,D] whose last Tq positions are q's.

    One new token sees everything (no mask); a prompt on an empty cache is plain causal; a
    chunk after cached tokens needs the offset mask SDPA's `is_causal` (top-left) cannot express.
    A cache that drops tokens (sinks + window) gives its own boolean [Tq, Tk] `mask`.
    """
    new, total = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if new == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = causal_mask(new, total, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    """Causal self-attention with `n_kv_heads` shared K/V heads and RoPE.

    Q, K and V come from one fused projection (rows: Hq*D queries, then Hkv*D keys, then
    Hkv*D values): at batch 1 one matmul beats three. With `qk_norm` each query and key head
    is RMS-normalised before RoPE; layer `layer`'s sliding window (ModelConfig.window_of), if
    any, masks keys that far back, unless the cache drops them itself (`window_mask`).
    """

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_size
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.scale, self.window = config.query_scale, config.window_of(layer)
        self.qkv = nn.Linear(config.dim, self.q_size + 2 * self.kv_size, bias=config.bias)
        self.o = nn.Linear(self.q_size, config.dim, bias=config.bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm

    def _normed(self, heads: torch.Tensor, head_axis: int) -> torch.Tensor:
        """`heads` with its query and key heads RMS-normalised (a no-op without qk_norm)."""
        if not self.qk_norm:
            return heads
        q, k, v = heads.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=head_axis)
        return torch.cat((self.q_norm(q), self.k_norm(k), v), dim=head_axis)

    def forward(self, x: torch.Tensor, rope: RoPE, start: int = 0, cache=None, layer: int = 0,
                step: Optional[StepBatch] = None) -> torch.Tensor:
        """x [B,T,dim] at positions start..start+T-1; `cache` (a kvlab.cache.KVCache) grows by T.

        With `step`, x [1, N, dim] is several sequences' new tokens packed in one row and
        `cache` is the engine's KVPool: positions, pool slots and block tables come from `step`.
        """
        if step is not None:
            return self._forward_step(x, rope, cache, layer, step)
        batch, new, _ = x.shape
        heads = self.qkv(x).view(batch, new, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        q_and_k = self.n_heads + self.n_kv_heads
        heads = self._normed(heads, 1)
        v = heads[:, q_and_k:]
        if cache is not None and cache.pre_rope:
            # A pre-RoPE cache (KVQuant-style) stores raw keys and rotates what it returns.
            q, k = rope(heads[:, :self.n_heads], start), heads[:, self.n_heads:q_and_k]
        else:
            rotated = rope(heads[:, :q_and_k], start)  # queries and keys in one call
            q, k = rotated[:, :self.n_heads], rotated[:, self.n_heads:]
        mask = None
        if cache is not None:
            k, v = cache.update(layer, k, v)
            mask = cache.window_mask(layer, new)  # a cache that drops tokens knows which positions it kept
        if mask is None and self.window:
            mask = sliding_mask(new, k.shape[-2], self.window, x.device)
        y = attend(q, k, v, scale=self.scale, mask=mask)
        return self.o(y.transpose(1, 2).reshape(batch, new, self.q_size))

    def _forward_step(self, x: torch.Tensor, rope: RoPE, pool, layer: int, step: StepBatch) -> torch.Tensor:
        """The packed, paged path: one projection for every sequence's tokens, attention per sequence
        over what layer `layer`'s KV group holds of it (a sliding group masks what left its window)."""
        tokens = x.shape[1]
        heads = self.qkv(x[0]).view(tokens, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(0, 1)
        q_and_k = self.n_heads + self.n_kv_heads
        heads = self._normed(heads, 0)
        # a pre-RoPE pool (KVQuant's per-channel keys) stores keys as they are; they are rotated once read
        pre_rope = getattr(pool, "pre_rope", False)
        rotated = rope.at(heads[:self.n_heads if pre_rope else q_and_k], step.positions)  # each token at its position
        q, k, v = rotated[:self.n_heads], (heads if pre_rope else rotated)[self.n_heads:q_and_k], heads[q_and_k:]
        pool.store(layer, k.transpose(0, 1), v.transpose(0, 1), step)
        outs, at = [], 0
        for s, new in enumerate(step.query_lens):
            keys, values, mask = pool.attention_inputs(layer, step, s, rope.at if pre_rope else None)
            outs.append(attend(q[None, :, at:at + new], keys[None], values[None], scale=self.scale, mask=mask)[0])
            at += new
        y = torch.cat(outs, dim=1)  # [Hq, N, D]
        return self.o(y.transpose(0, 1).reshape(1, tokens, self.q_size))
