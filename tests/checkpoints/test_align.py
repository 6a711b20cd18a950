"""Aligned KV-head merging (kvlab.checkpoints.align) on tiny random models, in float64 and fp32.

Merging one head is the identity; heads that are RoPE-commuting rotations (keys) and
orthogonal maps (values) of one another merge exactly; the maps applied to the queries commute
with RoPE; the whole conversion beats mean-pooling on a random model and keeps it exact when
there is nothing to merge; the grouping search finds the pairs that belong together.
"""

import math

import pytest
import torch

from kvlab.checkpoints.align import choose_groups, merge_keys, merge_layer, merge_values
from kvlab.checkpoints.convert import align_kv_heads, convert_kv_heads
from kvlab.checkpoints.rope_pairs import pair_channels, to_complex, to_real
from kvlab.nn.config import ModelConfig
from kvlab.nn.model import Decoder
from kvlab.plan.errors import PlanError

D, HEAD, IN = 8, 8, 24  # head dim, pairs x 2, input width


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sigma(seed=1, n=400):
    x = rand(n, IN, seed=seed)
    return x.T @ x / n


def rope_rotation(rows, angles, style):
    """Rows [d, in] with each pair f turned by angles[f] (a RoPE-commuting map of one head)."""
    return to_real(to_complex(rows, style) * torch.polar(torch.ones_like(angles), angles)[:, None], style)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_complex_pairs_round_trip_and_pair_the_channels_rope_rotates(style):
    rows = rand(2, HEAD, IN)
    assert torch.equal(to_real(to_complex(rows, style), style), rows)
    first, partner = pair_channels(HEAD, style)
    assert first == ([0, 1, 2, 3] if style == "half" else [0, 2, 4, 6])
    assert partner == ([4, 5, 6, 7] if style == "half" else [1, 3, 5, 7])


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_one_head_per_group_is_the_identity(style):
    wq, wk, wv, wo = rand(4, HEAD, IN), rand(2, HEAD, IN, seed=2), rand(2, HEAD, IN, seed=3), rand(IN, 4, HEAD, seed=4)
    merged = merge_layer(wq, wk, wv, wo, sigma(), [[0], [1]], style)
    for new, old in ((merged.wq, wq), (merged.wk, wk), (merged.wv, wv), (merged.wo, wo)):
        torch.testing.assert_close(new, old, rtol=1e-9, atol=1e-9)
    assert merged.key_kept == pytest.approx(1.0) and merged.value_kept == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_heads_that_are_rotations_of_one_another_merge_exactly(style):
    """Group of 2 KV heads: head 1's key is head 0's turned by a per-pair angle and scaled, its value an
    orthogonal map of head 0's. The merged layer computes every score and every output exactly."""
    base_k, base_v = rand(HEAD, IN, seed=5), rand(HEAD, IN, seed=6)
    angles = rand(HEAD // 2, seed=7)
    q_orth = torch.linalg.qr(rand(HEAD, HEAD, seed=8))[0]
    wk = torch.stack((base_k, 1.7 * rope_rotation(base_k, angles, style)))
    wv = torch.stack((base_v, q_orth @ base_v))
    wq, wo = rand(4, HEAD, IN, seed=9), rand(IN, 4, HEAD, seed=10)
    merged = merge_layer(wq, wk, wv, wo, sigma(), [[0, 1]], style)
    assert merged.key_kept == pytest.approx(1.0, abs=1e-9) and merged.value_kept == pytest.approx(1.0, abs=1e-9)
    x = rand(30, IN, seed=11)
    positions = torch.arange(30, dtype=torch.float64) * 3.0
    freqs = 10000.0 ** (-torch.arange(HEAD // 2, dtype=torch.float64) * 2 / HEAD)

    def rotated(rows, head_x):  # [n, d/2] complex, RoPE at each token's position
        turn = torch.polar(torch.ones(1, dtype=torch.float64), positions[:, None] * freqs)
        return (head_x.to(torch.complex128) @ to_complex(rows, style).T) * turn

    for h in range(4):  # query head h reads source KV head h // 2
        before = (rotated(wq[h], x).conj() @ rotated(wk[h // 2], x).T).real
        after = (rotated(merged.wq[h], x).conj() @ rotated(merged.wk[0], x).T).real
        torch.testing.assert_close(after, before, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(x @ merged.wv[0].T @ merged.wo[:, h].T, x @ wv[h // 2].T @ wo[:, h].T,
                                   rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_the_query_maps_commute_with_rope(style):
    """Each query pair is mapped by a complex number (a 2x2 rotation and scale), which commutes with any
    rotation of that pair: map then rotate equals rotate then map, at every angle."""
    wq, wk = rand(4, HEAD, IN), rand(2, HEAD, IN, seed=2)
    _, queries, _ = merge_keys(wq, wk, sigma(), 2, [0, 1], style)
    first, partner = pair_channels(HEAD, style)
    for h in range(4):
        for f in range(HEAD // 2):
            old = wq[h][[first[f], partner[f]]]  # [2, in]
            new = queries[h][[first[f], partner[f]]]
            linear = torch.linalg.lstsq(old.T, new.T).solution.T  # new = linear @ old
            torch.testing.assert_close(linear @ old, new, rtol=1e-9, atol=1e-9)
            for angle in (0.3, 1.1, -2.0):
                c, s = math.cos(angle), math.sin(angle)
                turn = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
                torch.testing.assert_close(linear @ turn, turn @ linear, rtol=1e-9, atol=1e-9)


def test_value_merge_keeps_the_best_summary_of_the_group():
    wv, wo = rand(2, HEAD, IN, seed=3), rand(IN, 4, HEAD, seed=4)
    merged, columns, kept = merge_values(wv, wo, sigma(), 2, [0, 1])
    assert merged.shape == (HEAD, IN) and columns.shape == (IN, 4, HEAD) and 0.5 < kept < 1.0


def tiny(kv_heads=4, heads=8, style="half"):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=heads, n_kv_heads=kv_heads, max_seq_len=64,
                         rope_style=style)
    return Decoder(config).eval()


def test_grouping_finds_the_heads_that_belong_together():
    """KV heads 0 and 2 are copies, and so are 1 and 3: the best pairs are {0, 2} and {1, 3}, not the
    consecutive {0, 1}, {2, 3} mean-pooling would use."""
    wk, wv = rand(4, HEAD, IN, seed=2), rand(4, HEAD, IN, seed=3)
    wk[2], wv[2], wk[3], wv[3] = wk[0], wv[0], wk[1], wv[1]
    groups = choose_groups(rand(8, HEAD, IN), wk, wv, rand(IN, 8, HEAD, seed=4), sigma(), 2, "half")
    assert sorted(map(sorted, groups)) == [[0, 2], [1, 3]]


def test_aligned_conversion_beats_mean_pooling_and_permutes_heads_consistently():
    model = tiny()
    calibration = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        source = model(x)
        aligned = convert_kv_heads(model, 2, "aligned", calibration=calibration)(x)
        mean = convert_kv_heads(model, 2, "mean")(x)
    assert (aligned - source).norm() < (mean - source).norm()
    result = align_kv_heads(model, 1, calibration)
    assert result.model.config.kv_heads == 1 and len(result.layers) == 2
    assert all(0 < layer["key_energy_kept"] <= 1 and layer["output_refit_error"] < 1 for layer in result.layers)


def test_nothing_to_merge_is_an_exact_copy_and_aligned_needs_calibration():
    model = tiny()
    x = torch.randint(0, 64, (1, 20))
    same = convert_kv_heads(model, 4, "aligned")
    assert torch.equal(same(x), model(x))
    more = convert_kv_heads(model, 8, "aligned")
    torch.testing.assert_close(more(x), model(x), rtol=0, atol=1e-6)
    assert "repeated" in more.config.name
    with pytest.raises(PlanError, match="calibration"):
        convert_kv_heads(model, 2, "aligned")
    with pytest.raises(PlanError, match="cannot be pooled into 3"):
        convert_kv_heads(tiny(4, 12), 3, "aligned")
