"""KVQuant (Hooper et al., 2024): non-uniform codebooks, pre-RoPE per-channel keys, dense-and-sparse.

Each token's head vector is stored as a row (kvlab.plan.kv_formats counts its bytes):
- keys are cached before RoPE and normalised per channel by an offline zero and range, the
  centre and half-width of each channel's calibration values once its 1% most extreme are set
  aside (KVQuant's per-channel keys: their outlier channels are the same at every token, so a
  per-channel range fits them and a per-token one would not); a key row stores no scale;
- values are normalised per token: min-max over the row's dense part, an fp16 scale and zero;
- each row's `ceil(dim * percent / 100)` values furthest out of that range are kept exactly in
  fp16 with their channel indices (the sparse part, which would otherwise stretch or clip the
  range); every other value becomes the index of its nearest centroid in the layer's codebook
  of 2**bits values, fitted offline on calibration activations (kvquant_calibration.py);
- the first `sink_tokens` tokens of a sequence (the attention sink) are kept whole in fp16.
The codebooks and channel statistics are per layer and fixed: the plan counts them once.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope
from kvlab.cache.bitpack import pack_bits, unpack_bits
from kvlab.cache.codecs import Fields, FloatCodec, RowCodec
from kvlab.cache.rows import GrowingKV, GrowingRows
from kvlab.plan.kv_formats import KVQUANT, outlier_capacity, outlier_count_bytes, outlier_index_bytes, \
    outliers_per_row, packed_row_bytes, resolve_kv_format


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


def out_of_range(xn: Tensor) -> Tensor:
    """How far each channel-normalised key lies outside [-1, 1] as |xn| (0 inside): the outlier ranking."""
    return torch.where(xn.abs() > 1, xn.abs(), torch.zeros_like(xn))


def take_outliers(xn: Tensor, used: Tensor, rows_before: int, percent: int) -> Tensor:
    """Mask of the outliers of n new key rows xn [*lead, n, D] (channel-normalised), written after
    `rows_before` rows that took `used` [*lead] of the head's pool.

    Row r (counting every row of the sequence) may hold its out-of-range values, furthest out
    first, while the pool of outlier_capacity(r + 1) slots has room after the rows before it: a
    row uses the slots earlier rows left free and never a later row's, so a row's outliers are
    the same whichever step writes it (a prompt in one chunk or several, a decode, a recompute
    after preemption). With k_r values out of range and C_r the capacity, the slots taken by
    rows up to r are u_r = min(u_{r-1} + k_r, C_r); unrolled, u_r = K_r + min(used, min_{j<=r}
    (C_j - K_j)) with K the running sum of k, one cummin.
    """
    score = out_of_range(xn)
    n, dim = xn.shape[-2], xn.shape[-1]
    wanted = (score > 0).sum(-1)  # [*lead, n]
    wanted_sum = wanted.cumsum(-1)
    rows = torch.arange(rows_before + 1, rows_before + n + 1, device=xn.device)
    capacity = rows * dim * percent // 100  # kvlab.plan.kv_formats.outlier_capacity, row by row
    slack = (capacity - wanted_sum).cummin(-1).values
    taken = wanted_sum + torch.minimum(used[..., None], slack)
    allowed = torch.diff(taken, dim=-1, prepend=used[..., None])  # each row's share
    rank = torch.empty_like(score, dtype=torch.long).scatter_(
        -1, score.argsort(dim=-1, descending=True, stable=True), torch.arange(dim, device=xn.device).expand_as(score))
    return (rank < allowed[..., None]) & (score > 0)


def value_dense(x: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Value rows: (u in [0, 1] over the row's dense range, fp16 zero, fp16 scale, outlier indices, mask)."""
    index, _, mask = split_outliers(x, count)
    zero, scale = dense_range(x, mask)
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return ((x - zero.float()) / step).clamp(0, 1), zero, scale, index, mask


class KVQuantKeyRows:
    """One layer's pre-RoPE key rows: codebook indices over a per-channel offline range, and the
    values outside that range in a per-head pool of fp16 outliers (compressed sparse rows).

    `codebook` [2**bits] in [-1, 1], sorted; `zero`/`range_` [H, D]: each channel's centre and
    half-width, so a key x is stored as codebook(clip((x - zero) / range)) unless it is an
    outlier. Each row stores its outlier count; the pool of head h holds
    outlier_capacity(rows, dim, percent) slots, filled in row order, so a token with many
    out-of-range values (they cluster in a few tokens) uses slots others left free. Has
    GrowingRows' interface (append, read, tensors, clear).
    """

    def __init__(self, dim: int, bits: int, outlier_percent: int, codebook: Tensor, zero: Tensor, range_: Tensor,
                 lead: tuple[int, ...], device: torch.device) -> None:
        if codebook.numel() != 1 << bits:
            raise CacheError(f"a {bits}-bit codebook has {1 << bits} centroids, got {codebook.numel()}")
        self.dim, self.bits, self.percent, self.lead, self.device = dim, bits, outlier_percent, lead, device
        self.index_dtype = torch.uint8 if outlier_index_bytes(dim) == 1 else torch.int16
        self.count_dtype = torch.uint8 if outlier_count_bytes(dim) == 1 else torch.int16
        self.codebook = codebook.to(torch.float16).sort().values.to(device)
        self.zero = zero.to(torch.float16)[None, :, None, :].to(device)
        self.range = range_.to(torch.float16)[None, :, None, :].to(device)
        self.clear()

    def clear(self) -> None:
        empty = lambda *shape, dtype: torch.zeros(*self.lead, *shape, dtype=dtype, device=self.device)  # noqa: E731
        self.codes = empty(0, packed_row_bytes(self.dim, self.bits), dtype=torch.uint8)
        self.counts = empty(0, 1, dtype=self.count_dtype)
        self.outlier_values = empty(0, dtype=torch.float16)
        self.outlier_index = empty(0, dtype=self.index_dtype)

    def constants(self) -> list[Tensor]:
        """The fixed tensors (codebook, channel zero and range) the plan counts once per layer."""
        return [self.codebook, self.zero, self.range]

    def tensors(self) -> Iterator[Tensor]:
        return iter((self.codes, self.counts, self.outlier_values, self.outlier_index))

    def normalise(self, x: Tensor) -> Tensor:
        return (x.float() - self.zero.float()) / self.range.float()

    def append(self, x: Tensor) -> None:
        """Encode rows x [*lead, n, dim] after the rows already held."""
        x = x.to(self.device)
        xn = self.normalise(x)
        before = self.codes.shape[-2]
        capacity = outlier_capacity(before + x.shape[-2], self.dim, self.percent)
        used = self.counts.long().sum(dim=(-2, -1))
        mask = take_outliers(xn, used, before, self.percent)
        flat = mask.flatten(2)
        slot = torch.where(flat, used[..., None] + flat.long().cumsum(-1) - 1, torch.full_like(used[..., None], capacity))
        grow = capacity - self.outlier_values.shape[-1]
        channel = torch.arange(flat.shape[-1], device=self.device) % self.dim
        values = F.pad(self.outlier_values, (0, grow + 1)).scatter(-1, slot, x.flatten(2).to(torch.float16))
        index = F.pad(self.outlier_index, (0, grow + 1)).scatter(-1, slot, channel.to(self.index_dtype).expand_as(slot))
        self.outlier_values, self.outlier_index = values[..., :capacity], index[..., :capacity]
        codes = nearest_code(xn.clamp(-1, 1), self.codebook.float())
        self.codes = torch.cat([self.codes, pack_bits(codes, self.bits)], dim=-2)
        self.counts = torch.cat([self.counts, mask.sum(-1, keepdim=True).to(self.count_dtype)], dim=-2)

    def read(self, dtype: torch.dtype) -> Tensor:
        rows = self.codes.shape[-2]
        x = self.codebook.float()[unpack_bits(self.codes, self.bits, self.dim)] * self.range.float() + self.zero.float()
        capacity = self.outlier_values.shape[-1]
        if capacity:
            ends = self.counts.long().squeeze(-1).cumsum(-1)  # [*lead, rows]: where each row's outliers end
            slot = torch.arange(capacity, device=self.device).expand(*self.lead, capacity).contiguous()
            row = torch.searchsorted(ends, slot, right=True)
            target = torch.where(slot < ends[..., -1:], row * self.dim + self.outlier_index.long(), rows * self.dim)
            x = F.pad(x.flatten(2), (0, 1)).scatter(-1, target, self.outlier_values.float())[..., :-1].view_as(x)
        return x.to(dtype)


class KVQuantValueCodec(RowCodec):
    """One layer's value rows: codebook indices over the row's own range, fp16 scale/zero and outliers.

    `codebook` [2**bits] in [0, 1], sorted.
    """

    def __init__(self, dim: int, bits: int, outlier_percent: int, codebook: Tensor) -> None:
        if codebook.numel() != 1 << bits:
            raise CacheError(f"a {bits}-bit codebook has {1 << bits} centroids, got {codebook.numel()}")
        self.dim, self.bits = dim, bits
        self.outliers = outliers_per_row(dim, outlier_percent)
        self.index_dtype = torch.uint8 if outlier_index_bytes(dim) == 1 else torch.int16
        self.codebook = codebook.to(torch.float16).sort().values

    def fields(self) -> dict[str, tuple[int, torch.dtype]]:
        return {"codes": (packed_row_bytes(self.dim, self.bits), torch.uint8),
                "zero": (1, torch.float16), "scale": (1, torch.float16),
                "outlier_values": (self.outliers, torch.float16), "outlier_index": (self.outliers, self.index_dtype)}

    def constants(self) -> list[Tensor]:
        """The fixed tensor (the codebook) the plan counts once per layer."""
        return [self.codebook]

    def encode(self, x: Tensor) -> Fields:
        x = x.float()
        u, zero, scale, index, _ = value_dense(x, self.outliers)
        codes = nearest_code(u, self.codebook.float().to(x.device))
        return {"codes": pack_bits(codes, self.bits), "zero": zero, "scale": scale,
                "outlier_values": x.gather(-1, index).to(torch.float16), "outlier_index": index.to(self.index_dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> Tensor:
        codes = unpack_bits(fields["codes"], self.bits, self.dim)
        x = self.codebook.float().to(codes.device)[codes] * fields["scale"].float() + fields["zero"].float()
        if self.outliers:
            x = x.scatter(-1, fields["outlier_index"].long(), fields["outlier_values"].float())
        return x.to(dtype)


class KVQuantCache(GrowingKV, KVCache):
    """Pre-RoPE KVQuant rows per layer, each layer with its own codecs; grows with the tokens held.

    A sequence's first `sink_tokens` tokens go to fp16 rows instead (KVQuant's attention-sink
    handling: the first token draws much of every query's attention, so its error costs most).
    """

    def __init__(self, shape: KVShape, k_rows: list[KVQuantKeyRows], v_codecs: list[KVQuantValueCodec],
                 rope: Rope, compute_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 sink_tokens: int = 0) -> None:
        super().__init__(shape, compute_dtype, pre_rope=True, rope=rope, device=device)
        if len(k_rows) != shape.num_layers or len(v_codecs) != shape.num_layers:
            raise CacheError(f"KVQuant needs codecs for all {shape.num_layers} layers")
        if sink_tokens < 0:
            raise CacheError(f"sink_tokens must be non-negative, got {sink_tokens}")
        lead = (shape.batch, shape.kv_heads)
        self.sink_tokens = sink_tokens
        self.v_codecs = v_codecs
        self.k_rows = k_rows
        self.v_rows = [GrowingRows(codec, lead, self.device) for codec in v_codecs]
        sink_k, sink_v = FloatCodec(shape.k_head_dim, torch.float16), FloatCodec(shape.v_head_dim, torch.float16)
        self.k_sink = [GrowingRows(sink_k, lead, self.device) for _ in k_rows]
        self.v_sink = [GrowingRows(sink_v, lead, self.device) for _ in v_codecs]

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        sink = max(0, min(self.sink_tokens - start, k.shape[2]))
        if sink:
            self.k_sink[layer].append(k[:, :, :sink])
            self.v_sink[layer].append(v[:, :, :sink])
        if sink < k.shape[2]:
            self.k_rows[layer].append(k[:, :, sink:])
            self.v_rows[layer].append(v[:, :, sink:])

    def _load(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        dtype = self.compute_dtype
        keys = torch.cat([self.k_sink[layer].read(dtype), self.k_rows[layer].read(dtype)], dim=2)
        values = torch.cat([self.v_sink[layer].read(dtype), self.v_rows[layer].read(dtype)], dim=2)
        return keys, values

    def tensors(self) -> Iterator[Tensor]:
        sinks = chain.from_iterable(rows.tensors() for rows in self.k_sink + self.v_sink)
        constants = chain.from_iterable(c.constants() for c in self.k_rows + self.v_codecs)
        return chain(super().tensors(), sinks, constants)

    def _clear(self) -> None:
        super()._clear()
        for rows in self.k_sink + self.v_sink:
            rows.clear()


def check_calibration(fmt, calibration) -> None:
    """A one-line CacheError unless `calibration` (a KVQuantCalibration) has codebooks for `fmt`'s bits, fitted
    for its outlier share: the lab's cache and the engine's pool refuse alike."""
    if calibration is None:
        raise CacheError(f"{fmt.name} needs a KVQuant calibration: `kvlab calibrate-kv MODEL --data FILE` "
                         "writes one, --kv-calibration FILE names it")
    if fmt.bits not in calibration.bits:
        raise CacheError(f"the calibration has codebooks for {sorted(calibration.bits)} bits, not {fmt.bits}")
    fitted = calibration.meta.get("outlier_percent", fmt.outlier_percent)
    if fitted != fmt.outlier_percent:
        raise CacheError(f"the calibration was fitted for {fitted}% outliers per row, {fmt.name} keeps "
                         f"{fmt.outlier_percent}%: run `kvlab calibrate-kv MODEL --data FILE` again")


def make_kvquant_cache(kv_cache_dtype: str, calibration, batch: int, max_tokens: int,
                       compute_dtype: torch.dtype, rope: Rope, device: torch.device | str | None = None) -> KVQuantCache:
    """A kvquant3/kvquant4 cache from a `KVQuantCalibration` (its layers, heads, dims and codebooks)."""
    fmt = resolve_kv_format(kv_cache_dtype)
    if fmt.scheme != KVQUANT:
        raise CacheError(f"{kv_cache_dtype} is not a KVQuant format (kvquant3, kvquant4)")
    bits = fmt.bits
    cal = calibration
    check_calibration(fmt, cal)
    place = torch.device(device) if device is not None else torch.device("cpu")
    k_rows = [KVQuantKeyRows(cal.head_dim, bits, fmt.outlier_percent, layer.k_codebooks[bits], layer.k_zero,
                             layer.k_range, (batch, cal.kv_heads), place) for layer in cal.layers]
    v_codecs = [KVQuantValueCodec(cal.head_dim, bits, fmt.outlier_percent, layer.v_codebooks[bits])
                for layer in cal.layers]
    shape = KVShape(len(cal.layers), batch, cal.kv_heads, cal.head_dim, cal.head_dim, max_tokens)
    cache = KVQuantCache(shape, k_rows, v_codecs, rope, compute_dtype, device, fmt.sink_tokens)
    cache.kv_format = fmt
    return cache
