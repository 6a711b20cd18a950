"""What a draft head trains on beyond the corpus: a features cache that a stopped run goes on from, and
ShareGPT conversations whose questions are never the held-out ones the reports measure on."""

import json

import torch

from kvlab.draft.features import FEATURES_FORMAT, load_or_collect
from kvlab.draft.prompts import sharegpt_conversations, sharegpt_questions, split


class Target(torch.nn.Module):
    """A stand-in target: hidden state = the ids as floats, logits that choose id + 1; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, tokens, with_hidden=False):
        self.calls += 1
        hidden = tokens[..., None].float().repeat(1, 1, 3)
        logits = torch.nn.functional.one_hot((tokens + 1) % 10, 10).float()
        return logits, hidden


def test_a_stopped_collection_keeps_what_it_has_and_the_next_goes_on_from_it(tmp_path):
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    path = tmp_path / "features.pt"
    target = Target()
    assert load_or_collect(path, target, sequences, "k", progress=False, max_seconds=-1.0) is None  # spent
    partial = torch.load(path, weights_only=False)
    assert partial["format"] == FEATURES_FORMAT and partial["complete"] is False and partial["records"] == []
    # as if a run had stopped after the first sequence
    first = load_or_collect(tmp_path / "whole.pt", Target(), sequences[:1], "k", progress=False)
    torch.save({**partial, "records": first}, path)
    records = load_or_collect(path, target, sequences, "k", progress=False)
    assert target.calls == 2  # only the two sequences it lacked
    assert [r["ids"].tolist() for r in records] == sequences
    assert records[2]["choice"].tolist() == [7, 8, 9, 0]
    assert torch.load(path, weights_only=False)["complete"] is True
    assert load_or_collect(path, target, sequences, "k", progress=False) is not None and target.calls == 2
    assert load_or_collect(path, target, sequences[:2], "another key", progress=False) is not None
    assert target.calls == 4  # another key is another cache


def conversation(question: str, answer: str = "An answer.") -> dict:
    return {"id": question, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def test_sharegpt_conversations_never_hold_a_held_out_question(tmp_path):
    questions = [f"Question number {i}: what is {i} squared?" for i in range(40)]
    path = tmp_path / "sharegpt.json"
    entries = [conversation(q, f"It is {i * i}.") for i, q in enumerate(questions)]
    entries += [conversation("Short?"), {"conversations": [{"from": "gpt", "value": "no human turn first"}]}]
    path.write_text(json.dumps(entries))
    held_out = set(split(sharegpt_questions(str(path), limit=1000), held_out=True))
    assert len(held_out) == 8
    pairs = sharegpt_conversations(str(path), 1000)
    assert len(pairs) == 32 and not {q for q, _ in pairs} & held_out
    assert all(a == f"It is {int(q.split()[2][:-1]) ** 2}." for q, a in pairs)  # each answer with its question
    assert sharegpt_conversations(str(path), 5) == pairs[:5]
