"""The EAGLE draft head: its reduced vocabulary's map, its band attention, save/load and refusal of another target."""

from types import SimpleNamespace

import pytest
import torch

from kvlab.nn.eagle import EagleConfig, EagleHead, HeadMismatch, band_mask, load_head, save_head

CONFIG = EagleConfig(target="tiny", dim=16, target_vocab=50, draft_vocab=8, n_heads=2, head_dim=8, ffn=24, window=3)


def head(seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    d2t = torch.randperm(50)[:8]
    return EagleHead(CONFIG, d2t)


def test_the_reduced_vocabulary_map_round_trips():
    h = head()
    t2d = h.t2d()
    assert t2d[h.d2t].tolist() == list(range(8))
    assert int((t2d >= 0).sum()) == 8
    logits = torch.randn(2, 8)
    full = h.full_logits(logits)
    assert torch.equal(full[:, h.d2t], logits)
    assert torch.isinf(full).sum() == 2 * (50 - 8)
    assert h.target_ids(logits.argmax(-1)).tolist() == full.argmax(-1).tolist()


def test_band_mask_sees_itself_and_window_minus_one_before():
    m = band_mask(5, 3)
    assert m.sum(1).tolist() == [1, 2, 3, 3, 3]
    assert m[4].tolist() == [False, False, True, True, True]


def test_a_position_only_reads_its_window():
    """Changing an input further back than the window leaves a position's output unchanged."""
    h = head().eval()
    e, x = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    f1, l1 = h(e, x)
    e2 = e.clone()
    e2[0, 0] += 5
    f2, l2 = h(e2, x)
    torch.testing.assert_close(f1[0, 3:], f2[0, 3:], rtol=0, atol=0)
    assert not torch.allclose(f1[0, :3], f2[0, :3])


@pytest.mark.parametrize("length", [1, 3, 6])
def test_the_last_position_alone_equals_the_full_pass_last_row(length):
    """A draft round reads only the last position (last_only): the same figures as the full pass's last row,
    also when the rows outnumber the window."""
    h = head().eval()
    e, x = torch.randn(2, length, 16), torch.randn(2, length, 16)
    with torch.no_grad():
        f, logits = h(e, x)
        f1, l1 = h(e, x, last_only=True)
    assert f1.shape == (2, 1, 16) and l1.shape == (2, 1, 8)
    torch.testing.assert_close(f1, f[:, -1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l1, logits[:, -1:], rtol=1e-6, atol=1e-6)


def test_save_load_round_trip_and_other_targets_are_refused(tmp_path):
    h = head()
    save_head(h, str(tmp_path / "head"), {"trained_tokens": 10})
    back = load_head(str(tmp_path / "head"), SimpleNamespace(dim=16, vocab_size=50, name="tiny"))
    for name, tensor in h.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name
    with pytest.raises(HeadMismatch, match="hidden size 16 and vocabulary 50; other has 32 and 50"):
        load_head(str(tmp_path / "head"), SimpleNamespace(dim=32, vocab_size=50, name="other"))
    with pytest.raises(HeadMismatch, match="not a draft head directory"):
        load_head(str(tmp_path / "nothing"))
