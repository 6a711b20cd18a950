"""The static cache: fixed [B, H, max_tokens, D] buffers per layer for K and V, as in gpt-fast.

Allocating the whole context up front keeps every address stable (what CUDA graphs and
torch.compile want) and makes the bytes exactly the plan's for max_tokens, whatever is used.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope
from kvlab.cache.codecs import FloatCodec, RowCodec
from kvlab.cache.rows import PreallocatedRows


class ContiguousCache(KVCache):
    """Preallocated per-token storage in any row codec (float, fp8 with a static scale, group ints)."""

    def __init__(self, shape: KVShape, k_codec: RowCodec, v_codec: RowCodec,
                 compute_dtype: torch.dtype = torch.float32, pre_rope: bool = False,
                 rope: Optional[Rope] = None, device: torch.device | str | None = None) -> None:
        super().__init__(shape, compute_dtype, pre_rope, rope, device)
        lead = (shape.batch, shape.kv_heads)
        self.k_rows = [PreallocatedRows(k_codec, lead, shape.max_tokens, self.device) for _ in range(shape.num_layers)]
        self.v_rows = [PreallocatedRows(v_codec, lead, shape.max_tokens, self.device) for _ in range(shape.num_layers)]

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        self.k_rows[layer].write(start, k)
        self.v_rows[layer].write(start, v)

    def _load(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        return self.k_rows[layer].read(end, self.compute_dtype), self.v_rows[layer].read(end, self.compute_dtype)

    def float_buffers(self, layer: int) -> Optional[tuple[Tensor, Tensor]]:
        """Layer `layer`'s K and V storage [B, H, max_tokens, D] when rows are stored as plain
        floats, else None."""
        k, v = self.k_rows[layer], self.v_rows[layer]
        if type(k.codec) is type(v.codec) is FloatCodec:  # one plane, "x", of rows as stored
            return k.buffers["x"], v.buffers["x"]
        return None

    def tensors(self) -> Iterator[Tensor]:
        return chain.from_iterable(rows.tensors() for rows in self.k_rows + self.v_rows)

    def _clear(self) -> None:
        pass  # stale rows past seq_len are never read, and the next writes overwrite them
