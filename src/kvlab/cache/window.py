"""Caches that drop what attention no longer sees: a model's sliding layers, and attention sinks
plus a recent window (StreamingLLM, Xiao et al., 2024) as a cache policy.

A sliding layer of window W (Gemma 3's 512) lets the query at position t see keys
t - W < p <= t, so after each step the layer keeps its newest W tokens: the planner's
min(context, W) for a SLIDING layer. Full layers of the same model keep everything.

A model trained with full attention can be served with a bounded cache: keep the first `sinks`
tokens (which attention leans on whatever they say) and the newest `window`, drop the middle.
Between steps the cache holds at most sinks + window tokens per layer, which the planner
counts like a sliding-window layer of that width; a query attends the held tokens and itself
(during a chunked prefill a chunk is held in full until its step ends, each query masked to
its own sinks and window). Keys keep the positions they were rotated at (no re-positioning:
evaluations here stay inside the model's trained context). Per-token formats only (float,
fp8, int8/4/2): rows are dropped whole. A layer with both a window of its own and the policy
keeps only what both allow.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope
from kvlab.cache.codecs import RowCodec, make_codec
from kvlab.cache.factory import kv_format
from kvlab.cache.rows import GrowingKV, GrowingRows
from kvlab.plan.kv_formats import FLOAT, GROUP


class SinkWindowCache(GrowingKV, KVCache):
    """Per-token rows of what each layer still sees, with their absolute positions: a sliding
    layer's newest `layer_windows[i]` tokens, and under the policy (`window` not None) the
    sinks and the newest `window` tokens."""

    def __init__(self, shape: KVShape, k_codec: RowCodec, v_codec: RowCodec, window: Optional[int], sinks: int,
                 compute_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 layer_windows: Optional[Sequence[Optional[int]]] = None) -> None:
        super().__init__(shape, compute_dtype, device=device)
        if (window is not None and window <= 0) or sinks < 0:
            raise CacheError(f"window must be positive and sinks non-negative, got {window} and {sinks}")
        layer_windows = tuple(layer_windows or (None,) * shape.num_layers)
        if len(layer_windows) != shape.num_layers or any(w is not None and w <= 0 for w in layer_windows):
            raise CacheError(f"layer_windows needs one positive window or None for each of {shape.num_layers} layers")
        if window is None and not any(layer_windows):
            raise CacheError("a window cache needs a window: the policy's, or a sliding layer's")
        self.window, self.sinks, self.layer_windows = window, sinks, layer_windows
        lead = (shape.batch, shape.kv_heads)
        self.k_rows = [GrowingRows(k_codec, lead, self.device) for _ in range(shape.num_layers)]
        self.v_rows = [GrowingRows(v_codec, lead, self.device) for _ in range(shape.num_layers)]
        self._clear()

    def held_tokens(self, layer_idx: int = 0) -> int:
        """Rows held in layer `layer_idx` now (seq_len counts every token seen)."""
        return int(self.positions[self._layer(layer_idx)].numel())

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().update(layer_idx, k, v)
        layer = self._layer(layer_idx)
        self._masks[layer] = self._mask(layer, k.shape[2])
        self._evict(layer)
        return keys, values

    def window_mask(self, layer_idx: int, new_tokens: int) -> Optional[Tensor]:
        return self._masks[self._layer(layer_idx)]

    def _mask(self, layer: int, new: int) -> Tensor:
        """Query at position t sees held position p when p <= t, t - p < its layer's window, and,
        under the policy, p is a sink or p >= t - window."""
        end = self.seq_len(layer)
        queries = torch.arange(end - new, end, device=self.device)[:, None]
        held = self.positions[layer][None, :]
        seen = held <= queries
        if self.layer_windows[layer]:
            seen &= held > queries - self.layer_windows[layer]
        if self.window is not None:
            seen &= (held < self.sinks) | (held >= queries - self.window)
        return seen

    def _evict(self, layer: int) -> None:
        end = self.seq_len(layer)
        positions = self.positions[layer]
        keep = torch.ones_like(positions, dtype=torch.bool)
        if self.layer_windows[layer]:
            keep &= positions >= end - self.layer_windows[layer]
        if self.window is not None:
            keep &= (positions < self.sinks) | (positions >= end - self.window)
        if bool(keep.all()):
            return
        index = keep.nonzero().flatten()
        for rows in (self.k_rows[layer], self.v_rows[layer]):
            rows.fields = {name: t.index_select(-2, index.to(t.device)) for name, t in rows.fields.items()}
        self.positions[layer] = positions[index]

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        super()._store(layer, start, k, v)
        new = torch.arange(start, start + k.shape[2], device=self.device)
        self.positions[layer] = torch.cat([self.positions[layer], new])

    def _clear(self) -> None:
        super()._clear()
        self.positions = [torch.empty(0, dtype=torch.long, device=self.device) for _ in range(self.num_layers)]
        self._masks: list[Optional[Tensor]] = [None] * self.num_layers


def make_window_cache(kv_cache_dtype: str, num_layers: int, batch: int, kv_heads: int, k_head_dim: int,
                      v_head_dim: int, max_tokens: int, window: Optional[int] = None, sinks: int = 0,
                      compute_dtype: torch.dtype = torch.float32, pre_rope: bool = False, rope: Optional[Rope] = None,
                      group_size: Optional[int] = None, device: torch.device | str | None = None,
                      layer_windows: Optional[Sequence[Optional[int]]] = None) -> SinkWindowCache:
    """A window cache in a per-token format: the sinks + `window` policy (None: no policy) over
    the model's own `layer_windows` (None per full layer); `max_tokens` bounds positions, not storage."""
    fmt = kv_format(kv_cache_dtype, compute_dtype, group_size)
    if fmt.scheme not in (FLOAT, GROUP):
        raise CacheError(f"a sinks + window cache drops whole token rows; {fmt.name} is not stored per token")
    if pre_rope:
        raise CacheError("a sinks + window cache keeps rotated keys (their positions are not contiguous)")
    shape = KVShape(num_layers, batch, kv_heads, k_head_dim, v_head_dim, max_tokens)
    cache = SinkWindowCache(shape, make_codec(fmt, k_head_dim), make_codec(fmt, v_head_dim), window, sinks,
                            compute_dtype, device, layer_windows)
    cache.kv_format = fmt
    return cache
