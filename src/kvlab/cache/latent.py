"""The MLA cache (DeepSeek-V2): one latent row per token instead of per-head keys and values.

Multi-head latent attention caches the compressed c_KV [B, T, kv_lora_rank] and the
decoupled RoPE key [B, T, rope_dim] shared by all heads (or, for kvlab's exact conversion of
a GQA model, one key per source KV head side by side: `rope_dim` is then their total width);
heads are re-derived by the up-projections (or absorbed into the query). Both live in one row of rank + rope_dim
elements per token, as the plan counts an "mla" layer. Float formats only (fp8 with a static
scale included): group-quantising a latent would mix two different kinds of channel.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, CacheStore, model_dtype_name
from kvlab.cache.codecs import RowCodec
from kvlab.cache.rows import PreallocatedRows
from kvlab.plan.kv_formats import KVFormat


class LatentCache(CacheStore):
    """Preallocated [B, max_tokens, kv_lora_rank + rope_dim] rows per layer."""

    kv_format: Optional[KVFormat] = None  # the plan's format, set by make_latent_cache

    def __init__(self, num_layers: int, batch: int, kv_lora_rank: int, rope_dim: int, max_tokens: int,
                 codec: RowCodec, compute_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_layers)
        model_dtype_name(compute_dtype)
        if codec.dim != kv_lora_rank + rope_dim:
            raise CacheError(f"codec rows have {codec.dim} channels, expected {kv_lora_rank} + {rope_dim}")
        self.batch, self.kv_lora_rank, self.rope_dim = batch, kv_lora_rank, rope_dim
        self.max_tokens = max_tokens
        self.compute_dtype = compute_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.rows = [PreallocatedRows(codec, (batch,), max_tokens, self.device) for _ in range(num_layers)]

    def update(self, layer_idx: int, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Store latent [B, T_new, rank] and k_rope [B, T_new, rope_dim]; return both for all tokens."""
        layer = self._layer(layer_idx)
        new = latent.shape[1] if latent.dim() == 3 else -1
        if (tuple(latent.shape), tuple(k_rope.shape)) != ((self.batch, new, self.kv_lora_rank),
                                                          (self.batch, new, self.rope_dim)):
            raise CacheError(f"latent must be [B={self.batch}, T_new, {self.kv_lora_rank}] and k_rope "
                             f"[B, T_new, {self.rope_dim}], got {list(latent.shape)} and {list(k_rope.shape)}")
        start = self._lengths[layer]
        end = start + latent.shape[1]
        if end > self.max_tokens:
            raise CacheError(f"layer {layer} would hold {end} tokens, over max_tokens={self.max_tokens}")
        self.rows[layer].write(start, torch.cat([latent, k_rope.to(latent.dtype)], dim=-1))
        self._lengths[layer] = end
        row = self.rows[layer].read(end, self.compute_dtype)
        return row[..., :self.kv_lora_rank], row[..., self.kv_lora_rank:]

    def tensors(self) -> Iterator[Tensor]:
        return chain.from_iterable(rows.tensors() for rows in self.rows)

    def _clear(self) -> None:
        pass  # rows past seq_len are never read
