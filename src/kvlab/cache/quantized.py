"""The group-quantised cache (int8/int4/int2): storage that grows with the tokens held.

Each token's head vector is quantised on arrival in groups of channels (quantize.py), so a
token never changes once stored and the cache holds exactly the plan's bytes for its
tokens: packed codes, plus an fp16 scale and zero point per group. Reads dequantise all of it.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvlab.cache.base import KVCache, KVShape, Rope
from kvlab.cache.codecs import RowCodec
from kvlab.cache.rows import GrowingKV, GrowingRows


class QuantizedCache(GrowingKV, KVCache):
    """Per-token quantised K and V in any row codec, holding only the tokens written."""

    def __init__(self, shape: KVShape, k_codec: RowCodec, v_codec: RowCodec,
                 compute_dtype: torch.dtype = torch.float32, pre_rope: bool = False,
                 rope: Optional[Rope] = None, device: torch.device | str | None = None) -> None:
        super().__init__(shape, compute_dtype, pre_rope, rope, device)
        lead = (shape.batch, shape.kv_heads)
        self.k_rows = [GrowingRows(k_codec, lead, self.device) for _ in range(shape.num_layers)]
        self.v_rows = [GrowingRows(v_codec, lead, self.device) for _ in range(shape.num_layers)]
