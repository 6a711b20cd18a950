"""KVQuant's offline calibration: per-layer codebooks and key channel ranges, fitted and stored.

`fit_layer` turns one layer's calibration activations (pre-RoPE keys and values, [H, N, D],
optionally with Fisher weights: the squared gradients of the loss) into what the cache needs:
- each key channel's range: the centre and half-width of its values between the
  outlier_percent/2 and 100 - outlier_percent/2 percentiles (KVQuant's offline per-channel
  outlier thresholds), so the rare values beyond them are the sparse part, not the range;
- per side a codebook, by weighted 1-D k-means on the dense part of each row after exactly the
  normalisation the codec applies (kvquant.py), so centroids sit where normalised values are
  dense, or, sensitivity-weighted, where errors cost the loss most. A weight w on value x maps
  to w * s^2 on its normalised value u (s: the key channel's range, or the value row's scale),
  since an error e in u is an error of s * e in x.

Stored as one safetensors file (tensors plus the shape and provenance in its metadata).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError
from kvlab.cache.kvquant import value_dense
from kvlab.plan.kv_formats import DEFAULT_OUTLIER_PERCENT, outliers_per_row

BITS = (3, 4)
KMEANS_ITERATIONS = 40
MIN_RANGE = 1e-4  # a channel that never moves keeps range 1e-4, not 0 (no division by zero)
FORMAT = "kvlab-kvquant-calibration"
VERSION = "2"  # 2: per-channel key zero/range from percentiles, key codebooks in [-1, 1], no key row scale


@dataclass
class LayerCalibration:
    k_zero: Tensor  # [H, D] fp16: each key channel's centre
    k_range: Tensor  # [H, D] fp16: ... and half-width
    k_codebooks: dict[int, Tensor]  # bits -> [2**bits] in [-1, 1]
    v_codebooks: dict[int, Tensor]  # bits -> [2**bits] in [0, 1]


@dataclass
class KVQuantCalibration:
    kv_heads: int
    head_dim: int
    layers: list[LayerCalibration]
    meta: dict = field(default_factory=dict)

    @property
    def bits(self) -> set[int]:
        return set(self.layers[0].k_codebooks) if self.layers else set()


def weighted_kmeans_1d(u: Tensor, weights: Optional[Tensor], centroids: int,
                       iterations: int = KMEANS_ITERATIONS) -> Tensor:
    """Lloyd's algorithm on values in [0, 1]; starts from the weighted quantiles, returns sorted centroids."""
    u = u.flatten().double()
    w = torch.ones_like(u) if weights is None else weights.flatten().double().clamp_min(0)
    if float(w.sum()) <= 0:
        w = torch.ones_like(u)
    order = u.argsort()
    cumulative = w[order].cumsum(0) / w.sum()
    targets = (torch.arange(centroids, dtype=torch.float64) + 0.5) / centroids
    c = u[order][torch.searchsorted(cumulative, targets).clamp_max(u.numel() - 1)]
    for _ in range(iterations):
        middles = (c[1:] + c[:-1]) / 2
        assign = torch.bucketize(u, middles)
        mass = torch.zeros(centroids, dtype=torch.float64).index_add_(0, assign, w)
        total = torch.zeros(centroids, dtype=torch.float64).index_add_(0, assign, w * u)
        c = torch.where(mass > 0, total / mass.clamp_min(1e-300), c).sort().values
    return c.float()


def channel_range(k: Tensor, outlier_percent: int) -> tuple[Tensor, Tensor]:
    """fp16 zero and range [H, D] of keys [H, N, D]: the centre and half-width of each channel's
    values between its outlier_percent/2 and 100 - outlier_percent/2 percentiles."""
    heads, tokens, dim = k.shape
    flat = k.transpose(1, 2).reshape(heads * dim, tokens)
    tail = outlier_percent / 200
    lo, hi = (torch.quantile(flat, q, dim=1).reshape(heads, dim) for q in (tail, 1 - tail))
    zero, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(MIN_RANGE)
    return zero.to(torch.float16), half.to(torch.float16)


def key_samples(k: Tensor, weights: Optional[Tensor], zero: Tensor,
                range_: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """The key codec's codebook inputs: keys [H, N, D] normalised per channel, inside [-1, 1]
    (those outside are the sparse part), and their weights."""
    u = (k - zero.float()[:, None]) / range_.float()[:, None]
    keep = u.abs() <= 1
    if weights is None:
        return u[keep], None
    return u[keep], (weights * range_.float()[:, None] ** 2)[keep]


def value_samples(v: Tensor, weights: Optional[Tensor], outlier_percent: int) -> tuple[Tensor, Optional[Tensor]]:
    """The value codec's [0, 1] codebook inputs over the dense part of rows v [..., D], and their weights."""
    u, _, scale, _, mask = value_dense(v, outliers_per_row(v.shape[-1], outlier_percent))
    keep = ~mask
    if weights is None:
        return u[keep], None
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return u[keep], (weights * step ** 2)[keep]


def fit_layer(k: Tensor, v: Tensor, k_weights: Optional[Tensor] = None, v_weights: Optional[Tensor] = None,
              bits: tuple[int, ...] = BITS, outlier_percent: int = DEFAULT_OUTLIER_PERCENT) -> LayerCalibration:
    """One layer's calibration from pre-RoPE keys and values [H, N, D] (and Fisher weights, same shape)."""
    k, v = k.float(), v.float()
    zero, range_ = channel_range(k, outlier_percent)
    ku, kw = key_samples(k, k_weights, zero, range_)
    vu, vw = value_samples(v, v_weights, outlier_percent)
    return LayerCalibration(zero, range_, {b: weighted_kmeans_1d(ku, kw, 1 << b) for b in bits},
                            {b: weighted_kmeans_1d(vu, vw, 1 << b) for b in bits})


def save_calibration(calibration: KVQuantCalibration, path: Path) -> None:
    """Write atomically (temporary file beside it, then rename)."""
    from safetensors.torch import save

    from kvlab.files import write_atomic

    tensors = {}
    for i, layer in enumerate(calibration.layers):
        tensors[f"layers.{i}.k_zero"] = layer.k_zero.contiguous()
        tensors[f"layers.{i}.k_range"] = layer.k_range.contiguous()
        for b in layer.k_codebooks:
            tensors[f"layers.{i}.k_codebook{b}"] = layer.k_codebooks[b].contiguous()
            tensors[f"layers.{i}.v_codebook{b}"] = layer.v_codebooks[b].contiguous()
    meta = {"format": FORMAT, "version": VERSION, "kv_heads": str(calibration.kv_heads),
            "head_dim": str(calibration.head_dim), "layers": str(len(calibration.layers)),
            "bits": ",".join(str(b) for b in sorted(calibration.bits)), "info": json.dumps(calibration.meta)}
    write_atomic(path, save(tensors, metadata=meta))


def load_calibration(path: Path, config=None) -> KVQuantCalibration:
    """Read a calibration; with a model `config`, check it was made for that many layers, heads and dims."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CacheError(f"no KVQuant calibration at {path}: run `kvlab calibrate-kv MODEL --data FILE` "
                         f"(with the same --kv-heads) or give --kv-calibration")
    try:
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for a corrupt file
        raise CacheError(f"{path} is not a KVQuant calibration ({error})") from None
    if meta.get("format") != FORMAT:
        raise CacheError(f"{path} is not a KVQuant calibration written by kvlab calibrate-kv")
    if meta.get("version") != VERSION:
        raise CacheError(f"{path} is an older KVQuant calibration (format {meta.get('version', '1')}, this kvlab "
                         f"reads {VERSION}): run `kvlab calibrate-kv MODEL --data FILE` again")
    bits = [int(b) for b in meta["bits"].split(",")]
    layers = [LayerCalibration(tensors[f"layers.{i}.k_zero"], tensors[f"layers.{i}.k_range"],
                               {b: tensors[f"layers.{i}.k_codebook{b}"] for b in bits},
                               {b: tensors[f"layers.{i}.v_codebook{b}"] for b in bits})
              for i in range(int(meta["layers"]))]
    calibration = KVQuantCalibration(int(meta["kv_heads"]), int(meta["head_dim"]), layers, json.loads(meta["info"]))
    if config is not None:
        want = (config.n_layers, config.kv_heads, config.head_size)
        got = (len(layers), calibration.kv_heads, calibration.head_dim)
        if want != got:
            raise CacheError(f"{path} was calibrated for {got[0]} layers x {got[1]} KV heads x {got[2]} dims, "
                             f"this model has {want[0]} x {want[1]} x {want[2]}; recalibrate with its --kv-heads")
    return calibration


def default_calibration_path(model_path: str, kv_heads: Optional[int] = None, method: str = "mean") -> Path:
    """Beside the model: `<file>.kvquant.safetensors`, or `kvquant.safetensors` in an HF directory."""
    suffix = "" if kv_heads is None else f"-kvh{kv_heads}-{method}"
    path = Path(model_path)
    if path.is_dir():
        return path / f"kvquant{suffix}.safetensors"
    return path.with_name(path.name + f".kvquant{suffix}.safetensors")
