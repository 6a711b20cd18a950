"""KVQuant (Hooper et al., 2024): non-uniform codebooks, pre-RoPE per-channel keys, dense-and-sparse.

Each token's head vector is stored as a row (kvlab.plan.kv_formats counts its bytes):
- keys are cached before RoPE and first normalised per channel by an offline mean and scale
  (their outlier channels are the same at every token, so this evens the row out);
- the row's `ceil(dim / 100)` (1%) largest-magnitude values are kept exactly in fp16 with
  their channel indices: the sparse part, which would otherwise stretch the row's range;
- the rest (the dense part) is min-max normalised to [0, 1] with an fp16 scale and zero,
  and each value becomes the index of its nearest centroid in the layer's codebook of
  2**bits values, fitted offline on calibration activations (kvquant_fit.py).
The codebooks and channel statistics are per layer and fixed: the plan counts them once.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope
from kvlab.cache.bitpack import pack_bits, unpack_bits
from kvlab.cache.codecs import Fields, RowCodec
from kvlab.cache.rows import GrowingKV, GrowingRows
from kvlab.plan.kv_formats import KVQUANT, outlier_index_bytes, outliers_per_row, packed_row_bytes, \
    resolve_kv_format


def nearest_code(u: Tensor, codebook: Tensor) -> Tensor:
    """Index of the nearest centroid of a sorted codebook for each value of u."""
    middles = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(u.contiguous(), middles.contiguous())


def split_outliers(x: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
    """The `count` largest-|x| channels of each row: (indices, values, mask of them)."""
    mask = torch.zeros_like(x, dtype=torch.bool)
    if count == 0:
        empty = x.new_zeros(*x.shape[:-1], 0)
        return empty.long(), empty, mask
    index = x.abs().topk(count, dim=-1).indices
    return index, x.gather(-1, index), mask.scatter_(-1, index, True)


def dense_range(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """fp16 zero (row minimum) and scale (max - min) over the values outside `mask`."""
    lo = x.masked_fill(mask, float("inf")).amin(-1, keepdim=True)
    hi = x.masked_fill(mask, float("-inf")).amax(-1, keepdim=True)
    return lo.to(torch.float16), (hi - lo).to(torch.float16)


class KVQuantCodec(RowCodec):
    """One layer's K or V rows: codebook indices, fp16 scale/zero, fp16 outliers with indices.

    `codebook` [2**bits] in [0, 1], sorted; `mean`/`scale` [H, D] normalise keys per channel
    (None for values).
    """

    def __init__(self, dim: int, bits: int, outlier_percent: int, codebook: Tensor,
                 mean: Optional[Tensor] = None, scale: Optional[Tensor] = None) -> None:
        if codebook.numel() != 1 << bits:
            raise CacheError(f"a {bits}-bit codebook has {1 << bits} centroids, got {codebook.numel()}")
        self.dim, self.bits = dim, bits
        self.outliers = outliers_per_row(dim, outlier_percent)
        self.index_dtype = torch.uint8 if outlier_index_bytes(dim) == 1 else torch.int16
        self.codebook = codebook.to(torch.float16).sort().values
        self.mean = None if mean is None else mean.to(torch.float16)[None, :, None, :]
        self.scale = None if scale is None else scale.to(torch.float16)[None, :, None, :]

    def fields(self) -> dict[str, tuple[int, torch.dtype]]:
        return {"codes": (packed_row_bytes(self.dim, self.bits), torch.uint8),
                "zero": (1, torch.float16), "scale": (1, torch.float16),
                "outlier_values": (self.outliers, torch.float16), "outlier_index": (self.outliers, self.index_dtype)}

    def constants(self) -> list[Tensor]:
        """The fixed tensors (codebook, channel mean and scale) the plan counts once per layer."""
        return [t for t in (self.codebook, self.mean, self.scale) if t is not None]

    def normalise(self, x: Tensor) -> Tensor:
        x = x.float()
        if self.mean is not None:
            x = (x - self.mean.float().to(x.device)) / self.scale.float().to(x.device)
        return x

    def encode(self, x: Tensor) -> Fields:
        x = self.normalise(x)
        index, values, mask = split_outliers(x, self.outliers)
        zero, scale = dense_range(x, mask)
        step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        u = ((x - zero.float()) / step).clamp_(0, 1)
        codes = nearest_code(u, self.codebook.float().to(x.device))
        return {"codes": pack_bits(codes, self.bits), "zero": zero, "scale": scale,
                "outlier_values": values.to(torch.float16), "outlier_index": index.to(self.index_dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> Tensor:
        codes = unpack_bits(fields["codes"], self.bits, self.dim)
        x = self.codebook.float().to(codes.device)[codes] * fields["scale"].float() + fields["zero"].float()
        if self.outliers:
            x = x.scatter(-1, fields["outlier_index"].long(), fields["outlier_values"].float())
        if self.mean is not None:
            x = x * self.scale.float().to(x.device) + self.mean.float().to(x.device)
        return x.to(dtype)


class KVQuantCache(GrowingKV, KVCache):
    """Pre-RoPE KVQuant rows per layer, each layer with its own codecs; grows with the tokens held."""

    def __init__(self, shape: KVShape, k_codecs: list[KVQuantCodec], v_codecs: list[KVQuantCodec], rope: Rope,
                 compute_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(shape, compute_dtype, pre_rope=True, rope=rope, device=device)
        if len(k_codecs) != shape.num_layers or len(v_codecs) != shape.num_layers:
            raise CacheError(f"KVQuant needs codecs for all {shape.num_layers} layers")
        lead = (shape.batch, shape.kv_heads)
        self.k_codecs, self.v_codecs = k_codecs, v_codecs
        self.k_rows = [GrowingRows(codec, lead, self.device) for codec in k_codecs]
        self.v_rows = [GrowingRows(codec, lead, self.device) for codec in v_codecs]

    def tensors(self) -> Iterator[Tensor]:
        constants = chain.from_iterable(c.constants() for c in self.k_codecs + self.v_codecs)
        return chain(super().tensors(), constants)


def make_kvquant_cache(kv_cache_dtype: str, calibration, batch: int, max_tokens: int,
                       compute_dtype: torch.dtype, rope: Rope, device: torch.device | str | None = None) -> KVQuantCache:
    """A kvquant3/kvquant4 cache from a `KVQuantCalibration` (its layers, heads, dims and codebooks)."""
    fmt = resolve_kv_format(kv_cache_dtype)
    if fmt.scheme != KVQUANT:
        raise CacheError(f"{kv_cache_dtype} is not a KVQuant format (kvquant3, kvquant4)")
    bits = fmt.bits
    cal = calibration
    if bits not in cal.bits:
        raise CacheError(f"the calibration has codebooks for {sorted(cal.bits)} bits, not {bits}")
    k_codecs = [KVQuantCodec(cal.head_dim, bits, fmt.outlier_percent, layer.k_codebooks[bits], layer.k_mean,
                             layer.k_scale) for layer in cal.layers]
    v_codecs = [KVQuantCodec(cal.head_dim, bits, fmt.outlier_percent, layer.v_codebooks[bits])
                for layer in cal.layers]
    shape = KVShape(len(cal.layers), batch, cal.kv_heads, cal.head_dim, cal.head_dim, max_tokens)
    cache = KVQuantCache(shape, k_codecs, v_codecs, rope, compute_dtype, device)
    cache.kv_format = fmt
    return cache
