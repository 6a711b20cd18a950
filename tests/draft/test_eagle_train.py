"""The EAGLE head's training data: which positions feed which targets, and the draft vocabulary."""

import random

import torch

from kvlab.draft.eagle_train import EagleTrainConfig, draft_vocabulary, losses, make_batch, windows
from kvlab.nn.eagle import EagleConfig, EagleHead
from draft_records import record


def test_a_window_pairs_h_i_with_the_next_token_and_targets_the_targets_next_choices():
    r = record(12)
    embedding = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    emb, hid, nxt, emb2, y1, y2 = make_batch([r], [(0, 3)], 5, embedding)
    ids, h, a = r["ids"].long(), r["hidden"].float(), r["choice"].long()
    for j in range(5):
        i = 3 + j
        assert torch.equal(emb[0, j], embedding[ids[i + 1]])  # x_{i+1}
        assert torch.equal(hid[0, j], h[i]) and torch.equal(nxt[0, j], h[i + 1])
        assert y1[0, j] == a[i + 1]  # the target's choice for x_{i+2}
        assert torch.equal(emb2[0, j], embedding[ids[i + 2]]) and y2[0, j] == a[i + 2]


def test_short_records_pad_with_ignored_targets():
    r = record(6)
    emb, hid, nxt, emb2, y1, y2 = make_batch([r], [(0, 0)], 8, torch.randn(10, 4))
    assert (y1[0] >= 0).sum() == 4 and (y2[0] >= 0).sum() == 3  # positions 0..3 have a_{i+1}; 0..2 a_{i+2}
    picks = windows([r], 8, random.Random(0), 20)
    assert all(s + min(8, 6 - 2) <= 6 - 2 for _, s in picks)


def test_the_draft_vocabulary_is_the_most_frequent_choices():
    records = [{"choice": torch.tensor([3, 3, 3, 5, 5, 1], dtype=torch.int32)}]
    d2t, coverage = draft_vocabulary(records, 2, 10)
    assert d2t.tolist() == [3, 5] and coverage == 5 / 6


def test_choices_outside_the_draft_vocabulary_are_skipped_by_the_loss():
    config = EagleConfig(target="t", dim=4, target_vocab=10, draft_vocab=2, n_heads=1, head_dim=4, ffn=8)
    head = EagleHead(config, torch.tensor([3, 5]))
    batch = make_batch([record(10)], [(0, 0)], 6, torch.randn(10, 4))
    outside = batch[4].clone()
    outside[outside >= 0] = 7  # not in {3, 5}: nothing to learn, and no NaN either
    out = losses(head, head.t2d(), batch[:4] + (outside, outside), EagleTrainConfig().feature_weight, 0.5)
    assert float(out["ce1"].detach()) == 0.0 and float(out["ce2"].detach()) == 0.0 and torch.isfinite(out["loss"])
    inside = batch[4].clone()
    inside[inside >= 0] = 3
    out = losses(head, head.t2d(), batch[:4] + (inside, batch[5]), 0.5, 0.0)
    assert float(out["ce1"].detach()) > 0


def test_answers_only_keeps_targets_inside_the_answer():
    r = {**record(12), "answer_from": 7}
    *_, y1, y2 = make_batch([r], [(0, 2)], 6, torch.randn(10, 4), answers_only=True)
    # window position j: i = 2 + j; a_{i+1} scores x_{i+2}, kept when i + 2 >= 7; a_{i+2} when i + 3 >= 7
    assert [int(v >= 0) for v in y1[0]] == [0, 0, 0, 1, 1, 1]
    assert [int(v >= 0) for v in y2[0]] == [0, 0, 1, 1, 1, 1]
