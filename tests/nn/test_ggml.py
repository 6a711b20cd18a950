"""GGMLLinear: kvlab's C kernels on llama.cpp's Q4_1 and Q8_0 blocks."""

import numpy as np
import pytest
import torch

from kvlab.nn.ggml import PREFILL_ROWS, GGMLLinear, kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler or no AVX2 here")


def q4_1_rows(out_features: int, in_features: int, rng: np.random.Generator):
    """Random Q4_1 rows and the weights they encode (w = q d + m per 32-weight block)."""
    blocks = in_features // 32
    d = rng.uniform(0.001, 0.02, (out_features, blocks)).astype(np.float16)
    m = rng.uniform(-0.2, 0.0, (out_features, blocks)).astype(np.float16)
    q = rng.integers(0, 16, (out_features, blocks, 32), dtype=np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    raw = np.concatenate((d[..., None].view(np.uint8), m[..., None].view(np.uint8), packed), axis=-1)
    dense = q * d[..., None].astype(np.float32) + m[..., None].astype(np.float32)
    return torch.from_numpy(raw.reshape(out_features, -1)), torch.from_numpy(dense.reshape(out_features, -1))


def q8_0_rows(out_features: int, in_features: int, rng: np.random.Generator):
    blocks = in_features // 32
    d = rng.uniform(0.001, 0.02, (out_features, blocks)).astype(np.float16)
    q = rng.integers(-128, 128, (out_features, blocks, 32)).astype(np.int8)
    raw = np.concatenate((d[..., None].view(np.uint8), q.view(np.uint8)), axis=-1)
    dense = q * d[..., None].astype(np.float32)
    return torch.from_numpy(raw.reshape(out_features, -1)), torch.from_numpy(dense.reshape(out_features, -1))


@pytest.mark.parametrize("kind,make", [("q4_1", q4_1_rows), ("q8_0", q8_0_rows)])
def test_weights_decode_exactly_and_products_match(kind, make):
    raw, dense = make(96, 160, np.random.default_rng(0))
    layer = GGMLLinear(raw, kind, 160)
    assert torch.equal(layer.weight, dense)  # the C dequantiser, exactly
    for rows in (1, 3, 4, 9, PREFILL_ROWS):  # integer products (row by row, 4-row tiles), then the float GEMM
        x = torch.randn(rows, 160)
        expected = x @ dense.t()
        error = (layer(x) - expected).norm() / expected.norm()
        assert error < (1e-5 if rows >= PREFILL_ROWS else 2e-4)  # int16 activations: 2e-5 to 6e-5 here


def test_shape_and_dtype_follow_the_input():
    raw, _ = q4_1_rows(32, 64, np.random.default_rng(1))
    y = GGMLLinear(raw, "q4_1", 64)(torch.randn(2, 1, 64, dtype=torch.float64))
    assert y.shape == (2, 1, 32) and y.dtype == torch.float64


def test_bad_rows_are_refused():
    raw, _ = q4_1_rows(32, 64, np.random.default_rng(2))
    with pytest.raises(ValueError, match="do not hold"):
        GGMLLinear(raw, "q4_1", 96)
