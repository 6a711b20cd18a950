"""Distillation for acceptance: the draft learns the target's next-token distribution on the target's text.

Acceptance of one drafted token at temperature 1 is sum_x min(p(x), q(x)) = 1 - TV(p, q)
(Leviathan et al.), so DistillSpec trains the draft to shrink a divergence between p (the
target) and q (the draft) on the target's own generations. Two objectives here, both on the
target's top-K distribution plus one remainder bucket (the mass outside its top K, against
the draft's mass outside the same K tokens):
- "kl": forward KL(p || q), the soft cross-entropy (smooth, fast to train);
- "tv": total variation, 1 - the expected acceptance rate itself.
Validation reports both, and the greedy agreement (the draft's argmax is the target's top
token): the acceptance rate at temperature 0 on the target's own text.

Loss positions are the generated tokens only; the prompt is context. Batches are a pure
function of (seed, step), as the trainer needs for exact resuming.
"""

from __future__ import annotations


import torch
from torch.nn import functional as F

from kvlab.train.data import batch_generator
from kvlab.train.loop import Trainer

OBJECTIVES = ("kl", "tv")


class DistillBatch:
    """Right-padded inputs [B, T], and for each loss position its (row, column) and the target's top-K."""

    def __init__(self, records: list[dict], block_size: int):
        inputs, rows, cols, top_ids, top_logprobs = [], [], [], [], []
        for r, record in enumerate(records):
            ids = torch.cat((record["prompt_ids"], record["output_ids"])).long()
            n_out = len(record["output_ids"])
            x = ids[:-1]
            first = len(ids) - 1 - n_out  # x[first] is the prompt's last token: it predicts output 0
            if len(x) > block_size:  # keep the end: every answer token and as much prompt as fits
                cut = len(x) - block_size
                x, first = x[cut:], first - cut
            keep = torch.arange(n_out) + first >= 0
            inputs.append(x)
            rows.append(torch.full((int(keep.sum()),), r))
            cols.append((torch.arange(n_out) + first)[keep])
            top_ids.append(record["top_ids"][keep].long())
            top_logprobs.append(record["top_logprobs"][keep].float())
        width = max(len(x) for x in inputs)
        self.x = torch.zeros(len(inputs), width, dtype=torch.long)
        for r, x in enumerate(inputs):
            self.x[r, :len(x)] = x
        self.rows, self.cols = torch.cat(rows), torch.cat(cols)
        self.top_ids, self.top_logprobs = torch.cat(top_ids), torch.cat(top_logprobs)

    @property
    def num_targets(self) -> int:
        return int(self.rows.numel())


def draft_log_probs(model, batch: DistillBatch) -> torch.Tensor:
    """The draft's log-probabilities [N, V] at the batch's loss positions (LM head on those rows only)."""
    x = model.embed(batch.x)
    for layer, block in enumerate(model.blocks):
        x = block(x, model.rope, 0, None, layer)
    hidden = model.norm(x[batch.rows, batch.cols])
    return F.log_softmax(model.lm_head(hidden).float(), dim=-1)


def divergences(logq: torch.Tensor, batch: DistillBatch) -> dict[str, torch.Tensor]:
    """Per position: forward KL and TV on top-K + remainder, and whether the argmaxes agree."""
    p = batch.top_logprobs.exp()
    q_top_log = logq.gather(1, batch.top_ids)
    q = q_top_log.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(1e-12)
    kl = (p * (batch.top_logprobs - q_top_log)).sum(-1) + torch.where(
        p_rest > 0, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(p_rest))
    tv = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
    agree = (logq.argmax(-1) == batch.top_ids[:, 0]).float()
    return {"kl": kl, "tv": tv, "agree": agree}


def batch_records(records: list[dict], seed: int, step: int, batch_size: int) -> list[dict]:
    picks = torch.randint(0, len(records), (batch_size,), generator=batch_generator(seed, step))
    return [records[i] for i in picks.tolist()]


class DistillTrainer(Trainer):
    """kvlab's resumable trainer with the distillation objective (see the module doc)."""

    def __init__(self, model, train_records: list[dict], val_records: list[dict], config, objective: str = "kl",
                 checkpoint=None, progress: bool = True, label: str = "distill", log=None):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        self.train_records, self.val_records, self.objective = train_records, val_records, objective
        super().__init__(model, None, config, checkpoint, progress, label, log)

    def train_batch(self, step: int) -> DistillBatch:
        config = self.config
        return DistillBatch(batch_records(self.train_records, config.seed, step, config.batch_size),
                            config.block_size)

    def batch_loss(self, batch: DistillBatch) -> torch.Tensor:
        return divergences(draft_log_probs(self.model, batch), batch)[self.objective].mean()

    def batch_tokens(self, batch: DistillBatch) -> int:
        return int(batch.x.numel())

    def validation_batches(self) -> list:
        size = self.config.batch_size
        return [DistillBatch(self.val_records[i:i + size], self.config.block_size)
                for i in range(0, len(self.val_records), size)][:self.config.eval_batches]

    @torch.no_grad()
    def validation_metrics(self) -> dict[str, float]:
        """Token-weighted means over the validation records: kl, tv, 1 - tv and greedy agreement."""
        was = self.model.training
        self.model.eval()
        sums: dict[str, float] = {"kl": 0.0, "tv": 0.0, "agree": 0.0}
        count = 0
        for batch in self.val_batches:
            d = divergences(draft_log_probs(self.model, batch), batch)
            for key in sums:
                sums[key] += float(d[key].sum())
            count += batch.num_targets
        self.model.train(was)
        out = {key: value / max(count, 1) for key, value in sums.items()}
        out["acceptance_t1"] = 1 - out["tv"]  # expected acceptance at temperature 1, sum_x min(p, q)
        out["tokens"] = count
        return out

    def validation_loss(self) -> float:
        return self.validation_metrics()[self.objective]


def split_records(records: list[dict], every: int = 20) -> tuple[list[dict], list[dict]]:
    """(train, validation): every `every`-th record is held out (at least one, from two records on)."""
    every = max(2, min(every, len(records)))
    return ([r for i, r in enumerate(records) if i % every != every - 1],
            [r for i, r in enumerate(records) if i % every == every - 1])


def trainable(records: list[dict]) -> list[dict]:
    return [r for r in records if len(r["output_ids"]) > 0 and r["top_ids"].shape[0] == len(r["output_ids"])]


__all__ = ["DistillTrainer", "DistillBatch", "divergences", "split_records", "trainable", "OBJECTIVES"]
