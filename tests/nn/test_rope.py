"""RoPE: both layouts, their equivalence under a channel permutation, and relative positions."""

import torch

from kvlab.nn.rope import HALF, INTERLEAVED, RoPE, apply_rope, rope_angles, rope_tables


def to_half_layout(x: torch.Tensor) -> torch.Tensor:
    """Channels (0,1),(2,3),... become pairs (i, i + dim/2): the permutation GGUF Q/K rows undergo."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def test_interleaved_is_complex_multiplication():
    """The RoPE paper's form: pair (x0, x1) is the complex number x0 + i x1, times e^{i p theta}."""
    torch.manual_seed(0)
    dim, positions = 8, 6
    x = torch.randn(2, positions, dim, dtype=torch.float64)
    cos, sin = rope_angles(dim, positions)
    expected = torch.view_as_real(torch.view_as_complex(x.view(2, positions, dim // 2, 2)) * torch.complex(cos, sin))
    cos_full, sin_full = rope_tables(dim, positions, style=INTERLEAVED)
    torch.testing.assert_close(apply_rope(x, cos_full.double(), sin_full.double(), INTERLEAVED),
                               expected.flatten(-2), rtol=1e-6, atol=1e-6)


def test_layouts_agree_after_permutation():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, 16)
    interleaved = apply_rope(x, *rope_tables(16, 5, 500.0, INTERLEAVED), INTERLEAVED)
    half = apply_rope(to_half_layout(x), *rope_tables(16, 5, 500.0, HALF), HALF)
    torch.testing.assert_close(to_half_layout(interleaved), half)


def test_rotation_keeps_norm_and_position_zero_is_identity():
    torch.manual_seed(2)
    for style in (HALF, INTERLEAVED):
        rope = RoPE(32, 64, base=100000.0, style=style)
        x = torch.randn(1, 2, 10, 32)
        y = rope(x, start=7)
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
        torch.testing.assert_close(rope(x[..., :1, :], start=0), x[..., :1, :])


def test_scores_depend_only_on_relative_position():
    torch.manual_seed(3)
    for style in (HALF, INTERLEAVED):
        rope = RoPE(16, 128, style=style)
        q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
        near = (rope(q, 10) * rope(k, 4)).sum()
        far = (rope(q, 100) * rope(k, 94)).sum()
        torch.testing.assert_close(near, far, rtol=1e-4, atol=1e-5)


def test_offset_equals_explicit_positions():
    torch.manual_seed(4)
    rope = RoPE(8, 32)
    x = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(rope(x, start=3), rope.at(x, torch.arange(3, 8)))
