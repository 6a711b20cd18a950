"""Training a Medusa head set (kvlab.nn.medusa) on the target's own hidden states.

Data: the same cached records as the EAGLE head's (kvlab.draft.features: the target's final
hidden state h_i and greedy choice a_i at every position of its own answers). Head j reads h_i
and is trained, by cross-entropy over the draft vocabulary, towards a_{i+j}: the target's choice
for x_{i+1+j} given the true prefix, which is what greedy verification checks once the earlier
drafts were right. Heads are weighted 0.8^(j-1) (Medusa's decay: the deeper guesses are worth
less, since they are only reached when the earlier ones were accepted). Choices outside the
draft vocabulary are skipped.

Held-out metrics, on answer tokens only: each head's greedy agreement (head j's argmax in target
ids == a_{i+j}), and the chain's, the share of positions where heads 1..j all agree: at
temperature 0 the expected tokens a round of k accepts is the sum of the chain's first k, so the
mean acceptance length is 1 + that sum ("acceptance_length_k" below).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from kvlab.draft.eagle_train import cross_entropy, windows
from kvlab.draft.head_trainer import HeadTrainer
from kvlab.nn.medusa import MedusaConfig, MedusaHead

CHECKPOINT_FORMAT = "kvlab-medusa-checkpoint-1"
DECAY = 0.8


@dataclass
class MedusaTrainConfig:
    steps: int = 600
    batch_size: int = 16
    window_len: int = 64
    lr: float = 1e-3
    draft_vocab: int = 8192
    token_budget: Optional[int] = None
    eval_every: int = 100
    seed: int = 0


def new_medusa(target, embedding: torch.Tensor, d2t: torch.Tensor, num_heads: int, num_layers: int = 1,
               seed: int = 0) -> MedusaHead:
    """A head set for `target`, its shared LM head the target's tied embedding rows for the draft vocabulary."""
    mc = target.config
    config = MedusaConfig(target=mc.name, dim=mc.dim, target_vocab=mc.vocab_size, draft_vocab=len(d2t),
                          num_heads=num_heads, num_layers=num_layers, norm_eps=mc.norm_eps)
    torch.manual_seed(seed)
    head = MedusaHead(config, d2t)
    with torch.no_grad():
        head.lm_head.weight.copy_(embedding[d2t])
    return head


def make_batch(records: list[dict], picks: list[tuple[int, int]], length: int, heads: int,
               answers_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [B, L, dim] (h_i) and targets [B, L, heads] (a_{i+j} for head j; -1 past the record's end,
    and with `answers_only` where x_{i+1+j} is not an answer token)."""
    dim = records[0]["hidden"].shape[1]
    hid = torch.zeros(len(picks), length, dim)
    y = torch.full((len(picks), length, heads), -1, dtype=torch.long)
    for b, (i, s) in enumerate(picks):
        r = records[i]
        n = len(r["ids"])
        span = min(length, n - s)
        hid[b, :span] = r["hidden"][s:s + span].float()
        a = r["choice"].long()
        first = r.get("answer_from", 0) if answers_only else 0
        for j in range(1, heads + 1):
            m = max(0, min(span, n - s - j))  # a_{i+j} exists for i + j < n
            y[b, :m, j - 1] = a[s + j:s + j + m]
            token_at = torch.arange(s + 1 + j, s + 1 + j + m)  # the position a_{i+j} chooses for
            y[b, :m, j - 1][token_at < first] = -1
    return hid, y


def losses(head: MedusaHead, t2d: torch.Tensor, batch) -> dict:
    hid, y = batch
    logits = head(hid)  # [B, L, heads, V']
    valid = y >= 0
    d = torch.where(valid, t2d[y.clamp_min(0)], -1)
    out = {"loss": logits.sum() * 0.0, "positions": int(valid[..., 0].sum())}
    right = (head.d2t[logits.argmax(-1)] == y) & valid
    chain = torch.ones_like(valid[..., 0])
    for j in range(y.shape[-1]):
        ce = cross_entropy(logits[..., j, :], d[..., j])
        out["loss"] = out["loss"] + DECAY ** j * ce
        out[f"ce{j + 1}"] = ce
        out[f"agree{j + 1}"] = right[..., j].sum() / valid[..., j].sum().clamp_min(1)
        chain = chain & right[..., j]
        out[f"chain{j + 1}"] = chain.sum() / valid[..., j].sum().clamp_min(1)
    return out


@torch.no_grad()
def evaluate(head: MedusaHead, t2d: torch.Tensor, records: list[dict], length: int) -> dict:
    """Per-head and chain agreement over every held-out answer position, and the greedy acceptance length."""
    head.eval()
    heads = head.config.num_heads
    picks = [(i, s) for i, r in enumerate(records) for s in range(0, len(r["ids"]) - 1, length)
             if len(r["ids"]) >= 4]
    right = torch.zeros(heads)
    chain = torch.zeros(heads)
    counts = torch.zeros(heads)
    for at in range(0, len(picks), 32):
        hid, y = make_batch(records, picks[at:at + 32], length, heads, answers_only=True)
        ok = (head.d2t[head(hid).argmax(-1)] == y) & (y >= 0)
        right += ok.sum((0, 1)).float()
        chain += ok.cumprod(-1).sum((0, 1)).float()  # cumprod of bools: heads 1..j all right
        counts += (y >= 0).sum((0, 1)).float()
    head.train()
    out = {"positions": int(counts[0])}
    for j in range(heads):
        out[f"agree{j + 1}"] = round(float(right[j] / counts[j].clamp_min(1)), 4)
        out[f"chain{j + 1}"] = round(float(chain[j] / counts[j].clamp_min(1)), 4)
    for k in range(1, heads + 1):
        out[f"acceptance_length_{k}"] = round(1 + sum(out[f"chain{j + 1}"] for j in range(k)), 4)
    return out


class MedusaTrainer(HeadTrainer):
    """The shared loop (kvlab.draft.head_trainer) on Medusa's per-head cross-entropies."""

    FORMAT = CHECKPOINT_FORMAT
    LABEL = "medusa heads"

    def __init__(self, head: MedusaHead, train: list[dict], val: list[dict], cfg: MedusaTrainConfig,
                 checkpoint: Path, log: Callable[[str], None] = lambda s: None, progress: bool = True) -> None:
        self.train, self.val = train, val
        super().__init__(head, cfg, checkpoint, log, progress)

    def batch(self, rng: random.Random):
        cfg = self.cfg
        return make_batch(self.train, windows(self.train, cfg.window_len, rng, cfg.batch_size), cfg.window_len,
                          self.head.config.num_heads)

    def losses(self, batch) -> dict:
        return losses(self.head, self.t2d, batch)

    def evaluate(self) -> dict:
        return evaluate(self.head, self.t2d, self.val, self.cfg.window_len)

    def describe(self, metrics: dict) -> str:
        heads = self.head.config.num_heads
        return ("val agreement per head " + ", ".join(f"{metrics[f'agree{j + 1}']:.3f}" for j in range(heads))
                + f"; greedy acceptance length at k={heads} {metrics[f'acceptance_length_{heads}']:.2f}")


__all__ = ["MedusaTrainConfig", "MedusaTrainer", "new_medusa", "make_batch", "losses", "evaluate"]
