"""Training an EAGLE head (kvlab.nn.eagle) on the target's own hidden states.

Data: the distillation corpus (kvlab.draft.corpus: the target's own answers to training-split
prompts, on-policy as DistillSpec argues) and optionally plain text files, run once through
the target with the engine's weights; each position keeps the final hidden state h_i (fp16)
and the target's greedy choice a_i = argmax p(. | x_<=i). Cached beside the output
(OUT.train/features.pt), so a resumed run does not pay for it again.

Draft vocabulary (FR-Spec): the `draft_vocab` most frequent greedy choices of the target over
the training positions, with the map back to target ids; the head's LM head starts from (and
stays at: frozen, as EAGLE keeps the target's) the target's tied embedding rows for them.

Loss, for a window of positions with inputs (embedding of x_{i+1}, h_i):
- step 1: cross-entropy of the head's logits against a_{i+1} (the target's choice for x_{i+2};
  positions whose choice is outside the draft vocabulary are skipped) plus a feature
  regression (smooth L1) of the head's feature against h_{i+1};
- step 2 (HASS-style, at half weight): the head's own features fed back in place of the
  target's, with the next tokens, against a_{i+2}: what a second draft round sees.
Held-out acceptance: the validation answers' greedy agreement at draft positions 1 and 2
(head argmax in target ids == the target's argmax) on answer tokens only, the acceptance rate at
temperature 0 when the head's inputs are the target's own features (teacher-forced).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from kvlab.draft.features import collect_features, draft_vocabulary, load_or_collect  # noqa: F401 (re-exported)
from kvlab.nn.eagle import EagleConfig, EagleHead
from kvlab.draft.head_trainer import HeadTrainer

CHECKPOINT_FORMAT = "kvlab-eagle-checkpoint-1"


@dataclass
class EagleTrainConfig:
    steps: int = 600
    batch_size: int = 16
    window_len: int = 64  # positions per training window
    lr: float = 1e-3
    draft_vocab: int = 8192
    token_budget: Optional[int] = None  # stop once this many positions were trained on
    eval_every: int = 100
    seed: int = 0
    feature_weight: float = 0.5
    second_step_weight: float = 0.5


def new_head(target, embedding: torch.Tensor, d2t: torch.Tensor, seed: int, **shape) -> EagleHead:
    mc = target.config
    config = EagleConfig(target=mc.name, dim=mc.dim, target_vocab=mc.vocab_size, draft_vocab=len(d2t),
                         norm_eps=mc.norm_eps, **shape)
    torch.manual_seed(seed)
    head = EagleHead(config, d2t)
    with torch.no_grad():
        head.lm_head.weight.copy_(embedding[d2t])  # SmolLM2's head is its tied embedding
        # start near "the feature is h_i": the fused input's hidden half passes through
        head.fc.weight.mul_(0.1)
        head.fc.weight[:, mc.dim:] += torch.eye(mc.dim)
    return head


def windows(records: list[dict], length: int, rng: random.Random, count: int) -> list[tuple[int, int]]:
    """(record, start) pairs; a window of `length` inputs needs length + 2 positions of its record."""
    usable = [i for i, r in enumerate(records) if len(r["ids"]) >= 4]
    out = []
    for _ in range(count):
        i = rng.choice(usable)
        n = len(records[i]["ids"])
        span = min(length, n - 2)
        out.append((i, rng.randrange(0, n - 1 - span)))
    return out


def make_batch(records, picks, length: int, embedding: torch.Tensor, answers_only: bool = False):
    """Inputs and targets for windows: emb(x_{i+1}), h_i, h_{i+1}, a_{i+1}, a_{i+2} (padded; mask).
    `answers_only` keeps the targets whose token is in the answer (a record's "answer_from" on): the
    chat template's fixed system prompt is easy to predict and says nothing about drafting answers."""
    B = len(picks)
    dim = embedding.shape[1]
    emb = torch.zeros(B, length, dim)
    hid = torch.zeros(B, length, dim)
    nxt = torch.zeros(B, length, dim)
    emb2 = torch.zeros(B, length, dim)
    y1 = torch.full((B, length), -1, dtype=torch.long)
    y2 = torch.full((B, length), -1, dtype=torch.long)
    for b, (i, s) in enumerate(picks):
        r = records[i]
        n = len(r["ids"])
        span = min(length, n - 2 - s)
        ids, h, a = r["ids"].long(), r["hidden"], r["choice"].long()
        emb[b, :span] = embedding[ids[s + 1:s + 1 + span]]
        hid[b, :span] = h[s:s + span].float()
        nxt[b, :span] = h[s + 1:s + 1 + span].float()
        y1[b, :span] = a[s + 1:s + 1 + span]
        # second round at position i + 1: the head's own feature for h_{i+1} and x_{i+2}, against a_{i+2}
        m = min(span, n - 3 - s)
        if m > 0:
            emb2[b, :m] = embedding[ids[s + 2:s + 2 + m]]
            y2[b, :m] = a[s + 2:s + 2 + m]
        if answers_only:  # a_{i+1} scores x_{i+2}: position i + 2 must be an answer token
            first = r.get("answer_from", 0)
            y1[b, :span][torch.arange(s + 2, s + 2 + span) < first] = -1
            y2[b, :max(m, 0)][torch.arange(s + 3, s + 3 + max(m, 0)) < first] = -1
    return emb, hid, nxt, emb2, y1, y2


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the targets >= 0; zero (not NaN) when a batch has none inside the draft vocabulary."""
    keep = targets.flatten() >= 0
    if not bool(keep.any()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits.flatten(0, 1)[keep], targets.flatten()[keep])


def losses(head: EagleHead, t2d: torch.Tensor, batch, feature_weight: float, second_weight: float) -> dict:
    emb, hid, nxt, emb2, y1, y2 = batch
    valid = y1 >= 0
    feats, logits = head(emb, hid)
    d1 = torch.where(valid, t2d[y1.clamp_min(0)], -1)
    ce1 = cross_entropy(logits, d1)
    reg = F.smooth_l1_loss(feats[valid], nxt[valid])
    _, logits2 = head(emb2, feats)
    d2 = torch.where(y2 >= 0, t2d[y2.clamp_min(0)], -1)
    ce2 = cross_entropy(logits2, d2)
    loss = ce1 + feature_weight * reg + second_weight * ce2
    agree1 = ((head.d2t[logits.argmax(-1)] == y1) & valid).sum() / valid.sum().clamp_min(1)
    valid2 = y2 >= 0
    agree2 = ((head.d2t[logits2.argmax(-1)] == y2) & valid2).sum() / valid2.sum().clamp_min(1)
    return {"loss": loss, "ce1": ce1, "reg": reg, "ce2": ce2, "agree1": agree1, "agree2": agree2,
            "positions": int(valid.sum())}


@torch.no_grad()
def evaluate(head: EagleHead, t2d, records, embedding, length: int, cfg: EagleTrainConfig) -> dict:
    """Greedy agreement at draft positions 1 and 2 over every held-out position (windows in order)."""
    head.eval()
    picks = [(i, s) for i, r in enumerate(records) for s in range(0, max(1, len(r["ids"]) - 2 - 1), length)
             if len(r["ids"]) >= 4]
    sums = {"ce1": 0.0, "agree1": 0.0, "agree2": 0.0}
    weight = 0
    for at in range(0, len(picks), 32):
        out = losses(head, t2d, make_batch(records, picks[at:at + 32], length, embedding, answers_only=True),
                     cfg.feature_weight, cfg.second_step_weight)
        n = out["positions"]
        for k in sums:
            sums[k] += float(out[k]) * n
        weight += n
    head.train()
    return {k: round(v / max(1, weight), 4) for k, v in sums.items()} | {"positions": weight}


class EagleTrainer(HeadTrainer):
    """The shared loop (kvlab.draft.head_trainer) on EAGLE windows: both draft steps' losses."""

    FORMAT = CHECKPOINT_FORMAT
    LABEL = "eagle head"

    def __init__(self, head: EagleHead, train: list[dict], val: list[dict], embedding: torch.Tensor,
                 cfg: EagleTrainConfig, checkpoint: Path, log: Callable[[str], None] = lambda s: None,
                 progress: bool = True) -> None:
        self.train, self.val, self.embedding = train, val, embedding
        super().__init__(head, cfg, checkpoint, log, progress)

    def batch(self, rng: random.Random):
        cfg = self.cfg
        return make_batch(self.train, windows(self.train, cfg.window_len, rng, cfg.batch_size), cfg.window_len,
                          self.embedding)

    def losses(self, batch) -> dict:
        return losses(self.head, self.t2d, batch, self.cfg.feature_weight, self.cfg.second_step_weight)

    def evaluate(self) -> dict:
        return evaluate(self.head, self.t2d, self.val, self.embedding, self.cfg.window_len, self.cfg)

    def describe(self, metrics: dict) -> str:
        return f"val agreement {metrics['agree1']:.3f} (position 1), {metrics['agree2']:.3f} (position 2)"


__all__ = ["EagleTrainConfig", "EagleTrainer", "collect_features", "load_or_collect", "draft_vocabulary",
           "new_head", "evaluate"]
