"""KIVI and group quantisation: what is quantised when, how accurately, and why per-channel keys.

KIVI (Liu et al., 2024): keys per channel over G tokens, values per token over G channels,
the newest R..R+G-1 tokens exact. KVQuant (Hooper et al., 2024): quantise keys before RoPE.
"""

from __future__ import annotations

import pytest
import torch

from cache_helpers import half_step_bound, rope
from kvlab.cache import make_cache
from kvlab.plan.kv_formats import kivi_quantised_tokens

B, H, DK, DV, G, R = 2, 3, 32, 20, 8, 16
COUNTS = [1, G - 1, G, R, R + G - 1, R + G, 3 * R + 5]


def kivi(bits: int = 4, residual: int = R, pre_rope: bool = False, max_tokens: int = 256, group: int = G):
    return make_cache(f"kivi{bits}", 1, B, H, DK, DV, max_tokens, group_size=group, residual=residual,
                      pre_rope=pre_rope, rope=rope if pre_rope else None)


def key_bound(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys group along tokens: bound each channel over each run of `group` tokens."""
    return half_step_bound(k.transpose(2, 3), bits, group).transpose(2, 3)


@pytest.mark.parametrize("tokens", COUNTS)
@pytest.mark.parametrize("residual", [0, R])
def test_kivi_quantises_whole_groups_beyond_the_window(tokens: int, residual: int) -> None:
    cache = kivi(residual=residual)
    for _ in range(tokens):  # decode one token at a time
        cache.update(0, torch.randn(B, H, 1, DK), torch.randn(B, H, 1, DV))
        quantised, held = cache.quantised_tokens(), cache.seq_len()
        assert quantised == max(0, held - residual) // G * G  # whole groups of G beyond the residual
        assert residual <= held - quantised < residual + G or quantised == 0
    assert quantised == kivi_quantised_tokens(tokens, G, residual)


@pytest.mark.parametrize("tokens,quantised", [(15, 0), (23, 0), (24, 8), (31, 8), (32, 16), (69, 48)])
def test_kivi_quantised_counts_worked_by_hand(tokens: int, quantised: int) -> None:
    """G=8, R=16: nothing until R + G tokens, then a group of 8 at every 8 more (hand-counted)."""
    cache = kivi()
    cache.update(0, torch.randn(B, H, tokens, DK), torch.randn(B, H, tokens, DV))
    assert cache.quantised_tokens() == kivi_quantised_tokens(tokens, G, R) == quantised


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("tokens", COUNTS)
def test_kivi_error_within_half_a_step_and_residual_exact(bits: int, tokens: int) -> None:
    k = torch.randn(B, H, tokens, DK) * torch.linspace(0.2, 5, DK)
    v = torch.randn(B, H, tokens, DV) * 3
    cache = kivi(bits)
    split = min(tokens, 5)
    cache.update(0, k[:, :, :split], v[:, :, :split])
    keys, values = cache.update(0, k[:, :, split:], v[:, :, split:])
    q = kivi_quantised_tokens(tokens, G, R)
    assert torch.equal(keys[:, :, q:], k[:, :, q:]) and torch.equal(values[:, :, q:], v[:, :, q:])
    assert ((keys[:, :, :q] - k[:, :, :q]).abs() <= key_bound(k[:, :, :q], bits, G)).all()
    assert ((values[:, :, :q] - v[:, :, :q]).abs() <= half_step_bound(v[:, :, :q], bits, G)).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_group_cache_error_within_half_a_step(bits: int, tokens: int) -> None:
    k, v = torch.randn(B, H, tokens, DK) * 4, torch.randn(B, H, tokens, DV)
    cache = make_cache(f"int{bits}", 1, B, H, DK, DV, 64, group_size=G)
    keys, values = cache.update(0, k, v)
    assert ((keys - k).abs() <= half_step_bound(k, bits, G)).all()
    assert ((values - v).abs() <= half_step_bound(v, bits, G)).all()


OUTLIERS = [3, 17, 40]


@pytest.mark.parametrize("bits", [2, 4])
def test_per_channel_keys_beat_per_token_on_outlier_channels(bits: int) -> None:
    """KIVI's reason to exist: a few key channels 20x the rest (as in LLM keys) stretch every
    per-token group's range, so per-token quantisation blurs all the ordinary channels;
    per-channel groups confine the damage to the outliers. Same bits, same group size."""
    k = torch.randn(B, H, 128, 64)
    k[..., OUTLIERS] *= 20
    v = torch.randn_like(k)
    per_channel = make_cache(f"kivi{bits}", 1, B, H, 64, 64, 128, group_size=32, residual=0)
    per_token = make_cache(f"int{bits}", 1, B, H, 64, 64, 128, group_size=32)
    kivi_error = (per_channel.update(0, k, v)[0] - k).pow(2)
    group_error = (per_token.update(0, k, v)[0] - k).pow(2)
    ordinary = [c for c in range(64) if c not in OUTLIERS]
    assert kivi_error.mean() < group_error.mean() / 1.5
    assert kivi_error[..., ordinary].mean() < group_error[..., ordinary].mean() / 10


def test_pre_rope_keys_are_roped_after_dequantisation() -> None:
    """The pre-RoPE cache returns rope(dequant(k)): equal to roping a post-hoc cache's keys,
    and within each pair's two half-steps of the roped originals (RoPE turns channel pairs)."""
    k, v = torch.randn(B, H, 3 * R + 5, DK), torch.randn(B, H, 3 * R + 5, DV)
    pre, plain = kivi(pre_rope=True), kivi()
    keys, _ = pre.update(0, k, v)
    dequantised, _ = plain.update(0, k, v)
    positions = torch.arange(k.shape[2])
    assert torch.allclose(keys, rope(dequantised, positions), atol=1e-5)
    q = kivi_quantised_tokens(k.shape[2], G, R)
    bound = key_bound(k[:, :, :q], 4, G)
    pair_bound = bound + bound.roll(DK // 2, dims=-1)  # channel i turns with channel i +- D/2
    assert ((keys - rope(k, positions))[:, :, :q].abs() <= pair_bound + 1e-5).all()


def test_pre_rope_quantisation_beats_post_rope_on_biased_outlier_channels() -> None:
    """KVQuant: outlier channels with a steady offset have a narrow per-channel range before RoPE;
    RoPE swings them through +-20 across positions, widening every group's range."""
    k = torch.randn(B, H, 128, DK)
    k[..., [0, DK // 2]] += 20  # the highest-frequency pair (it turns one radian per position)
    v = torch.randn(B, H, 128, DV)
    positions = torch.arange(128)
    roped = rope(k, positions)
    pre = make_cache("kivi2", 1, B, H, DK, DV, 128, group_size=32, residual=0, pre_rope=True, rope=rope)
    post = make_cache("kivi2", 1, B, H, DK, DV, 128, group_size=32, residual=0)
    pre_error = (pre.update(0, k, v)[0] - roped).pow(2).mean()
    post_error = (post.update(0, roped, v)[0] - roped).pow(2).mean()
    assert pre_error < post_error / 5
