"""Int4Linear: Q4_1-style codes computed by PyTorch's CPU int4 kernel equal the dense weights."""

import pytest
import torch

from kvlab.nn.int4 import Int4Linear


def q4_1_weights(out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, in_features // 32, generator=g) * 0.01
    offset = -torch.rand(out_features, in_features // 32, generator=g) * 0.05
    dense = codes * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    return codes, scale, offset, dense


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64)])
def test_weights_equal_q4_1_dequantisation_up_to_bf16_scales(shape):
    codes, scale, offset, dense = q4_1_weights(*shape)
    layer = Int4Linear.from_offset_codes(codes, scale, offset, 32)
    # Only the per-group scale and zero are rounded to bf16: about 2^-8 of the group's largest weight.
    assert (layer.weight.float() - dense).abs().max() <= 2 ** -7 * dense.abs().max()


def test_forward_matches_dense_matmul_and_keeps_the_input_dtype():
    codes, scale, offset, _ = q4_1_weights(64, 128)
    layer = Int4Linear.from_offset_codes(codes, scale, offset, 32)
    x = torch.randn(2, 3, 128)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 64)
    expected = x.bfloat16().float() @ layer.weight.float().t()
    torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)


def test_model_to_fp32_keeps_the_kernel_dtype():
    codes, scale, offset, _ = q4_1_weights(32, 64)
    model = torch.nn.Sequential(Int4Linear.from_offset_codes(codes, scale, offset, 32))
    model.to(torch.float32)
    assert model[0].scales_zeros.dtype == torch.bfloat16
    model(torch.randn(1, 64))


def test_unsupported_shapes_are_refused():
    with pytest.raises(ValueError, match="out % 16"):
        Int4Linear(torch.zeros(20, 64, dtype=torch.long), torch.ones(20, 2), torch.zeros(20, 2), 32)
