"""KVQuant: dense bit packing, codebook fitting, exact outliers, and measured bytes == kvlab.plan."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.cache.bitpack import pack_bits, unpack_bits
from kvlab.cache.kvquant import KVQuantKeyRows, KVQuantValueCodec, make_kvquant_cache
from kvlab.cache.kvquant_calibration import fit_layer, KVQuantCalibration, load_calibration, save_calibration, \
    weighted_kmeans_1d
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence, kv_fixed_bytes
from kvlab.plan.kv_formats import kvquant_row_bytes, outlier_capacity, outliers_per_row, packed_row_bytes, \
    resolve_kv_format
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
    # 64 channels at 3 bits: a value row is 24 code bytes + fp16 scale and zero + 1 outlier (fp16 value,
    # uint8 index); a key row has no scale (its range is per channel, offline) but an outlier count, and
    # its head's pool holds floor(rows * 64 * 1%) outliers of 3 bytes
    assert kvquant_row_bytes(64, 3, 1, "k") == 24 + 1
    assert kvquant_row_bytes(64, 3, 1, "v") == 24 + 4 + 3
    assert outlier_capacity(1, 64, 1) == 0 and outlier_capacity(2, 64, 1) == 1 and outlier_capacity(100, 64, 1) == 64
    assert outliers_per_row(64, 1) == 1 and outliers_per_row(100, 1) == 1 and outliers_per_row(101, 1) == 2
    assert kvquant_row_bytes(512, 4, 1, "v") == 256 + 4 + 6 * (2 + 2)  # past 256 channels an index is two bytes
    fmt = resolve_kv_format("kvquant4")
    assert fmt.fixed_bytes("k", 3, 64) == 16 * 2 + 2 * 3 * 64 * 2 and fmt.fixed_bytes("v", 3, 64) == 16 * 2
    # the first token (the attention sink) is held whole in fp16, every later one as a row
    sink = fmt.sink_tokens
    assert sink == 1
    assert fmt.bytes("k", 3, 64, 0) == 0 and fmt.bytes("k", 3, 64, 1) == 3 * 64 * 2
    assert fmt.bytes("v", 3, 64, 10) == 3 * 64 * 2 + 9 * 3 * (32 + 4 + 3)
    assert fmt.bytes("k", 3, 64, 101) == 3 * 64 * 2 + 100 * 3 * (32 + 1) + 3 * 64 * 3
    assert fmt.bytes_per_token("k", 3, 64) == 3 * (32 + 1 + 0.64 * 3)


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
        assert cache.seq_len(0) == held
    assert kv_fixed_bytes(spec, formats) == LAYERS * (2 * (1 << formats.k.bits) * 2 + 2 * HEADS * DIM * 2)


def test_outliers_come_back_exactly_and_three_bits_beat_uniform_min_max() -> None:
    cal = calibration(weighted=True)
    layer = cal.layers[0]
    codec = KVQuantValueCodec(DIM, 3, 1, layer.v_codebooks[3])
    x = torch.randn(1, HEADS, 50, DIM)
    x[..., 7] = 40.0  # an outlier channel far outside the rest
    y = codec.decode(codec.encode(x), torch.float32)
    assert torch.equal(y[..., 7], torch.full_like(y[..., 7], 40.0))  # 40 is exact in fp16
    err = (y - x).pow(2).mean()
    uniform = KVQuantValueCodec(DIM, 3, 0, torch.linspace(0, 1, 8))  # no outliers, evenly spaced levels
    err_uniform = (uniform.decode(uniform.encode(x), torch.float32) - x).pow(2).mean()
    assert err < err_uniform / 4


def key_rows(layer, bits: int, batch: int = 1, percent: int = 1) -> KVQuantKeyRows:
    return KVQuantKeyRows(DIM, bits, percent, layer.k_codebooks[bits], layer.k_zero, layer.k_range,
                          (batch, HEADS), torch.device("cpu"))


def test_key_rows_use_the_channel_ranges(tmp_path) -> None:
    cal = calibration()
    path = tmp_path / "cal.safetensors"
    save_calibration(cal, path)
    back = load_calibration(path)
    assert back.bits == {3, 4} and back.meta == {"test": True}
    for a, b in zip(cal.layers, back.layers):
        assert torch.equal(a.k_zero, b.k_zero) and torch.equal(a.k_range, b.k_range)
        assert torch.equal(a.v_codebooks[3], b.v_codebooks[3])
    k = torch.randn(1, HEADS, 30, DIM) * torch.linspace(0.2, 5, DIM) + 1.0
    rows = key_rows(back.layers[0], 4)
    rows.append(k)
    y = rows.read(torch.float32)
    assert (y - k).norm() / k.norm() < 0.1
    # the range is per channel: a channel 25x wider than another keeps about the same relative error
    err = (y - k).pow(2).mean(dim=(0, 1, 2)).sqrt()
    spread = (k - k.mean(dim=2, keepdim=True)).pow(2).mean(dim=(0, 1, 2)).sqrt()
    assert (err / spread).max() < 3 * (err / spread).median()


def test_key_outliers_are_the_values_out_of_range_wherever_they_cluster() -> None:
    zero, range_ = torch.zeros(HEADS, DIM), torch.ones(HEADS, DIM)
    range_[:, 3] = 100.0  # a wide channel
    cb = torch.linspace(-1, 1, 8)
    rows = KVQuantKeyRows(DIM, 3, 5, cb, zero, range_, (2, HEADS), torch.device("cpu"))  # 1 slot per row
    k = (torch.rand(2, HEADS, 6, DIM) - 0.5) * 1.8  # inside every range
    k[..., 3] = 30.0  # large, but 0.3 of its channel's range: coded, not an outlier
    k[:, :, 3, 10:14] = torch.tensor([-7.0, 6.0, 5.0, 4.0])  # 4 outliers in one token: it borrows the slots
    k[0, 0, 5, 16] = 2.0                                      # the 3 tokens before it left free
    rows.append(k[:, :, :4])
    rows.append(k[:, :, 4:])  # a second chunk: more slots, the pool grows
    y = rows.read(torch.float32)
    assert torch.equal(y[:, :, 3, 10:14], k[:, :, 3, 10:14]) and y[0, 0, 5, 16] == 2.0
    assert not torch.equal(y[..., 3], k[..., 3])
    assert rows.counts.sum() == 2 * HEADS * 4 + 1 and rows.outlier_values.shape[-1] == outlier_capacity(6, DIM, 5) == 6
    # past the pool's capacity the least-out-of-range values are clipped to the outermost centroid
    tight = KVQuantKeyRows(DIM, 3, 20, cb, zero, range_, (1, HEADS), torch.device("cpu"))
    few = k[:1, :, :2].clone()  # 2 rows: 8 slots per head, 4 + 5 values out of range
    few[:, :, 0, 14:19] = torch.tensor([3.0, -2.5, 1.5, 1.2, 1.1])
    few[:, :, 1, 10:14] = torch.tensor([-7.0, 6.0, 5.0, 4.0])
    tight.append(few)
    z = tight.read(torch.float32)
    assert torch.equal(z[:, :, 1, 10:14], few[:, :, 1, 10:14])
    assert torch.equal(z[:, :, 0, 14:18], few[:, :, 0, 14:18].half().float())  # fp16, like every outlier
    assert torch.all(z[:, :, 0, 18] == 1.0)
    # a token never takes a later token's slots, so its outliers do not depend on how rows are chunked:
    # the same cluster at token 1 keeps 2 of its 4 values (2 slots by then), in one chunk or one row at a time
    early = k.clone()
    early[:, :, 1, 10:14], early[:, :, 3, 10:14] = early[:, :, 3, 10:14], early[:, :, 1, 10:14]
    whole = KVQuantKeyRows(DIM, 3, 5, cb, zero, range_, (2, HEADS), torch.device("cpu"))
    whole.append(early)
    by_row = KVQuantKeyRows(DIM, 3, 5, cb, zero, range_, (2, HEADS), torch.device("cpu"))
    for t in range(6):
        by_row.append(early[:, :, t:t + 1])
    assert torch.equal(whole.read(torch.float32), by_row.read(torch.float32))
    assert torch.equal(whole.counts, by_row.counts) and int(whole.counts[0, 0, 1]) == 2
    # the key rows hold the plan's layout: codes and a count per row, 3 bytes per pool slot
    held = sum(t.numel() * t.element_size() for t in rows.tensors())
    assert held == 2 * HEADS * (6 * (packed_row_bytes(DIM, 3) + 1) + 6 * 3)


def test_the_sink_token_stays_exact_and_calibration_must_match_the_format(tmp_path) -> None:
    cal = calibration()
    cache = make_kvquant_cache("kvquant3", cal, 1, 16, torch.float32, rope_identity)
    first, later = torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 2, DIM)
    k1, v1 = cache.update(0, first, first + 1)
    k2, v2 = cache.update(0, later, later + 1)
    assert torch.equal(k2[:, :, :1], first[:, :, :1].half().float())
    assert torch.equal(v2[:, :, :1], (first[:, :, :1] + 1).half().float())
    assert not torch.equal(k2[:, :, 1:3], first[:, :, 1:3].half().float())  # the rest are quantised
    assert torch.equal(k2[:, :, :3], k1) and k2.shape[2] == 5
    cache.reset()
    assert cache.nbytes() == kv_fixed_bytes(ModelSpec("t", tuple(LayerAttention(FULL, 4, HEADS, DIM, DIM)
                                                                    for _ in range(LAYERS))), cache_formats("kvquant3"))
    cal.meta["outlier_percent"] = 5
    with pytest.raises(Exception, match="5% outliers"):
        make_kvquant_cache("kvquant3", cal, 1, 16, torch.float32, rope_identity)
