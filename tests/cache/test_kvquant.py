"""KVQuant: dense bit packing, codebook fitting, exact outliers, and measured bytes == kvlab.plan."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.cache.bitpack import pack_bits, unpack_bits
from kvlab.cache.kvquant import KVQuantCodec, make_kvquant_cache
from kvlab.cache.kvquant_calibration import fit_layer, KVQuantCalibration, load_calibration, save_calibration, \
    weighted_kmeans_1d
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_fixed_bytes
from kvlab.plan.kv_formats import kvquant_row_bytes, outliers_per_row, packed_row_bytes, resolve_kv_format
from kvlab.plan.spec import FULL, LayerAttention, ModelSpec

LAYERS, HEADS, DIM = 3, 2, 20


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [1, 7, 20, 64])
def test_bit_packing_round_trips_in_the_planned_bytes(bits: int, dim: int) -> None:
    codes = torch.randint(0, 1 << bits, (2, 3, 5, dim))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_row_bytes(dim, bits) == math.ceil(dim * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, dim), codes)


def test_row_bytes_follow_the_dense_and_sparse_layout() -> None:
    # 64 channels at 3 bits: 24 code bytes + fp16 scale and zero + 1 outlier (fp16 value, uint8 index)
    assert kvquant_row_bytes(64, 3, 1) == 24 + 4 + 3
    assert outliers_per_row(64, 1) == 1 and outliers_per_row(100, 1) == 1 and outliers_per_row(101, 1) == 2
    assert kvquant_row_bytes(512, 4, 1) == 256 + 4 + 6 * (2 + 2)  # past 256 channels an index is two bytes
    fmt = resolve_kv_format("kvquant4")
    assert fmt.fixed_bytes("k", 3, 64) == 16 * 2 + 2 * 3 * 64 * 2 and fmt.fixed_bytes("v", 3, 64) == 16 * 2


def test_kmeans_finds_separated_clusters_and_follows_weights() -> None:
    u = torch.cat([torch.full((100,), 0.1), torch.full((100,), 0.5), torch.full((100,), 0.9)])
    u = u + torch.randn(300) * 0.005
    centroids = weighted_kmeans_1d(u, None, 3)
    assert torch.allclose(centroids, torch.tensor([0.1, 0.5, 0.9]), atol=0.01)
    # One centroid for two clusters: the weighted mean moves toward the heavy one.
    two = torch.cat([torch.zeros(50), torch.ones(50)])
    heavy = weighted_kmeans_1d(two, torch.cat([torch.full((50,), 9.0), torch.ones(50)]), 1)
    assert heavy.item() == pytest.approx(0.1, abs=1e-6)


def calibration(bits=(3, 4), tokens: int = 200, weighted: bool = False) -> KVQuantCalibration:
    layers = []
    for _ in range(LAYERS):
        k = torch.randn(HEADS, tokens, DIM) * torch.linspace(0.2, 5, DIM) + 1.0  # uneven channels, an offset
        v = torch.randn(HEADS, tokens, DIM)
        weights = (torch.rand_like(k), torch.rand_like(v)) if weighted else (None, None)
        layers.append(fit_layer(k, v, *weights, bits=bits))
    return KVQuantCalibration(HEADS, DIM, layers, {"test": True})


def rope_identity(x, positions):
    return x


@pytest.mark.parametrize("dtype", ["kvquant3", "kvquant4"])
@pytest.mark.parametrize("chunks", [[1], [5, 1, 1], [17, 3], [1] * 9])
def test_measured_bytes_equal_the_plan(dtype: str, chunks: list[int]) -> None:
    cal = calibration()
    cache = make_kvquant_cache(dtype, cal, 2, 64, torch.float32, rope_identity)
    spec = ModelSpec("t", tuple(LayerAttention(FULL, 4, HEADS, DIM, DIM) for _ in range(LAYERS)))
    formats = cache_formats(dtype)
    held = 0
    for n in chunks:
        for layer in range(LAYERS):
            cache.update(layer, torch.randn(2, HEADS, n, DIM), torch.randn(2, HEADS, n, DIM))
        held += n
        assert cache.nbytes() == 2 * kv_bytes_per_sequence(spec, held, formats) + kv_fixed_bytes(spec, formats)
    assert kv_fixed_bytes(spec, formats) == LAYERS * (2 * (1 << formats.k.bits) * 2 + 2 * HEADS * DIM * 2)


def test_outliers_come_back_exactly_and_three_bits_beat_uniform_min_max() -> None:
    cal = calibration(weighted=True)
    layer = cal.layers[0]
    codec = KVQuantCodec(DIM, 3, 1, layer.v_codebooks[3])
    x = torch.randn(1, HEADS, 50, DIM)
    x[..., 7] = 40.0  # an outlier channel far outside the rest
    y = codec.decode(codec.encode(x), torch.float32)
    assert torch.equal(y[..., 7], torch.full_like(y[..., 7], 40.0))  # 40 is exact in fp16
    err = (y - x).pow(2).mean()
    uniform = KVQuantCodec(DIM, 3, 0, torch.linspace(0, 1, 8))  # no outliers, evenly spaced levels
    err_uniform = (uniform.decode(uniform.encode(x), torch.float32) - x).pow(2).mean()
    assert err < err_uniform / 4


def test_key_codec_uses_the_channel_statistics(tmp_path) -> None:
    cal = calibration()
    path = tmp_path / "cal.safetensors"
    save_calibration(cal, path)
    back = load_calibration(path)
    assert back.bits == {3, 4} and back.meta == {"test": True}
    for a, b in zip(cal.layers, back.layers):
        assert torch.equal(a.k_mean, b.k_mean) and torch.equal(a.v_codebooks[3], b.v_codebooks[3])
    k = torch.randn(1, HEADS, 30, DIM) * torch.linspace(0.2, 5, DIM) + 1.0
    codec = KVQuantCodec(DIM, 4, 1, back.layers[0].k_codebooks[4], back.layers[0].k_mean, back.layers[0].k_scale)
    rel = (codec.decode(codec.encode(k), torch.float32) - k).norm() / k.norm()
    assert rel < 0.08
