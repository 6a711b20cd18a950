"""The Medusa heads' training data and held-out metrics: which targets each head learns, and the chain."""

import torch

from kvlab.draft.medusa_train import evaluate, losses, make_batch
from kvlab.nn.medusa import MedusaConfig, MedusaHead
from draft_records import record


def test_head_j_at_position_i_targets_the_targets_choice_at_i_plus_j():
    r = record(12)
    hid, y = make_batch([r], [(0, 3)], 5, 3)
    a = r["choice"].long()
    for t in range(5):
        i = 3 + t
        assert torch.equal(hid[0, t], r["hidden"][i].float())
        assert y[0, t].tolist() == [int(a[i + j]) if i + j < 12 else -1 for j in (1, 2, 3)]
    _, y = make_batch([r], [(0, 8)], 5, 3)  # positions 8..11: head j ends where i + j reaches the end
    assert [int((y[0, :, j] >= 0).sum()) for j in range(3)] == [3, 2, 1]


def test_answers_only_keeps_targets_whose_token_is_in_the_answer():
    r = {**record(12), "answer_from": 7}
    _, y = make_batch([r], [(0, 2)], 4, 2, answers_only=True)
    # head j at position i chooses x_{i+1+j}: kept when i + 1 + j >= 7
    assert [[int(v >= 0) for v in y[0, :, j]] for j in range(2)] == [[0, 0, 0, 1], [0, 0, 1, 1]]


def test_the_chain_counts_positions_where_every_earlier_head_agrees():
    """Heads that always guess token 3: agreement per head is the share of 3s, the chain the share of runs of 3s."""
    config = MedusaConfig(target="t", dim=4, target_vocab=10, draft_vocab=2, num_heads=2)
    head = MedusaHead(config, torch.tensor([3, 5]))
    with torch.no_grad():
        head.lm_head.weight.copy_(torch.tensor([[0.0, 0, 0, 0], [-1e4, -1e4, -1e4, -1e4]]))
    choice = torch.tensor([0, 3, 3, 1, 3, 0, 3, 3, 3, 2], dtype=torch.int32)
    r = {"ids": torch.zeros(10, dtype=torch.int32), "hidden": torch.ones(10, 4).half(), "choice": choice}
    m = evaluate(head, head.t2d(), [r], 64)
    # head 1 at i targets choice[i+1] (i = 0..8), head 2 choice[i+2] (i = 0..7)
    assert m["agree1"] == round(6 / 9, 4) and m["agree2"] == round(5 / 8, 4)
    pairs = sum(int(choice[i + 1] == 3 and choice[i + 2] == 3) for i in range(8))
    assert m["chain2"] == round(pairs / 8, 4)
    assert m["acceptance_length_2"] == round(1 + m["chain1"] + m["chain2"], 4)
    out = losses(head, head.t2d(), make_batch([r], [(0, 0)], 8, 2))
    assert torch.isfinite(out["loss"]) and out["positions"] == 8
