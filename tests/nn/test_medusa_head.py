"""The Medusa head set: its reduced vocabulary's map, what each head reads, save/load and refusal of another target."""

from types import SimpleNamespace

import pytest
import torch

from kvlab.nn.draft_head import HeadMismatch, load_draft_head, save_head
from kvlab.nn.medusa import MedusaConfig, MedusaHead, load_medusa

CONFIG = MedusaConfig(target="tiny", dim=16, target_vocab=50, draft_vocab=8, num_heads=3, num_layers=2)
TINY = SimpleNamespace(dim=16, vocab_size=50, name="tiny")


def head(seed: int = 0) -> MedusaHead:
    torch.manual_seed(seed)
    h = MedusaHead(CONFIG, torch.randperm(50)[:8])
    for p in h.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return h


def test_the_reduced_vocabulary_map_round_trips():
    h = head()
    t2d = h.t2d()
    assert t2d[h.d2t].tolist() == list(range(8)) and int((t2d >= 0).sum()) == 8
    logits = h(torch.randn(5, 16))  # [5, heads, 8]
    full = h.full_logits(logits)
    assert full.shape == (5, 3, 50) and torch.equal(full[..., h.d2t], logits)
    assert h.target_ids(logits.argmax(-1)).tolist() == full.argmax(-1).tolist()


def test_each_head_is_a_residual_stack_on_the_same_hidden_state_through_one_lm_head():
    h = head()
    x = torch.randn(2, 4, 16)
    logits = h(x)
    assert logits.shape == (2, 4, 3, 8)
    for j, layers in enumerate(h.blocks):
        z = x
        for layer in layers:
            z = z + torch.nn.functional.silu(layer(z))
        torch.testing.assert_close(logits[..., j, :], z @ h.lm_head.weight.T)
    torch.testing.assert_close(h(x, heads=2), logits[..., :2, :])  # fewer heads: the first ones


def test_untrained_heads_guess_the_targets_own_next_token():
    """Blocks start at zero: every head's residual stream is h itself, scored by the LM head."""
    h = MedusaHead(CONFIG, torch.arange(8))
    x = torch.randn(3, 16)
    assert torch.equal(h.features(x), x[:, None].expand(3, 3, 16))


def test_save_load_round_trip_and_refusals(tmp_path):
    h = head()
    save_head(h, str(tmp_path / "m"), {"kvlab_train": {"held_out_agreement": 0.5}})
    back = load_medusa(str(tmp_path / "m"), TINY)
    for name, tensor in h.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name
    assert isinstance(load_draft_head(str(tmp_path / "m")), MedusaHead)
    with pytest.raises(HeadMismatch, match="hidden size 16 and vocabulary 50; other has 16 and 64"):
        load_medusa(str(tmp_path / "m"), SimpleNamespace(dim=16, vocab_size=64, name="other"))
    with pytest.raises(HeadMismatch, match="holds a kvlab-medusa-head, not a kvlab-eagle-head"):
        load_draft_head(str(tmp_path / "m"), architecture="kvlab-eagle-head")


def test_param_count_is_the_stored_parameters():
    assert CONFIG.param_count() == sum(p.numel() for p in head().parameters())
