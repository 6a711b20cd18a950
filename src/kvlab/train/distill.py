"""Recover a converted model by distillation from the model it came from.

The student (a mean-pooled GQA/MQA conversion) learns the teacher's next-token
distribution: loss = alpha x KL(teacher || student) at temperature T (scaled by T^2, Hinton
et al.) + (1 - alpha) x the language-model loss on the text. The text is either the user's
(`--data`) or the teacher's own samples, so no pre-training corpus is needed. Training is
kvlab.train.loop's Trainer (AdamW, warm-up and cosine, progress bar, atomic resumable
checkpoints) with the step's loss replaced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from kvlab.plan.errors import PlanError
from kvlab.train.data import train_batch
from kvlab.train.loop import Trainer


@dataclass
class TokenCorpus:
    """Token ids split 90/10, in the shape the Trainer reads (`train`, `val`)."""

    train: torch.Tensor
    val: torch.Tensor
    source: str


def token_corpus(ids: list[int], block_size: int, source: str) -> TokenCorpus:
    if len(ids) < 10 * (block_size + 1):
        raise PlanError(f"{len(ids)} tokens of {source} are too few for {block_size}-token windows "
                        f"(need {10 * (block_size + 1)}); give more text or a smaller --block-size")
    data = torch.tensor(ids, dtype=torch.long)
    cut = int(len(data) * 0.9)
    return TokenCorpus(data[:cut], data[cut:], source)


@torch.no_grad()
def teacher_text(teacher, tokens: int, start_id: int, length: int = 256, seed: int = 0, batch: int = 8,
                 progress: Optional[Callable[[int], None]] = None) -> list[int]:
    """`tokens` ids the teacher samples itself (temperature 1), in sequences of `length` from `start_id`,
    `batch` sequences per generate call (a decode step reads the weights once for all of them);
    `progress` is told how many ids each call added."""
    from kvlab.nn.generate import generate

    generator, ids = torch.Generator().manual_seed(seed), []
    while len(ids) < tokens:
        rows = min(batch, -(-(tokens - len(ids)) // (length - 1)))
        out = generate(teacher, [[start_id]] * rows, length - 1, temperature=1.0, generator=generator)
        ids.extend(int(t) for t in out.reshape(-1).tolist())
        if progress is not None:
            progress(out.numel())
    return ids[:tokens]


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 alpha: float, temperature: float) -> tuple[torch.Tensor, float, float]:
    """(loss, KL, LM loss) averaged per token."""
    vocab = student_logits.shape[-1]
    s, t = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1), log_target=True,
                  reduction="batchmean") * temperature ** 2
    lm = F.cross_entropy(s, targets.reshape(-1))
    return alpha * kl + (1 - alpha) * lm, kl.item(), lm.item()


class DistillTrainer(Trainer):
    """The Trainer with the distillation loss; validation stays the LM loss on held-out text."""

    def __init__(self, student, teacher, corpus: TokenCorpus, config, checkpoint=None, alpha: float = 0.5,
                 temperature: float = 1.0, **options) -> None:
        if not 0 <= alpha <= 1 or temperature <= 0:
            raise PlanError(f"--alpha must be in [0, 1] and --temperature positive, got {alpha}, {temperature}")
        self.teacher, self.alpha, self.temperature = teacher.eval(), alpha, temperature
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        self.last: Optional[tuple[float, float]] = None
        super().__init__(student, corpus, config, checkpoint, **options)

    def _step(self) -> float:
        from kvlab.train.loop import lr_at

        config, state = self.config, self.state
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(state.step, config)
        x, y = train_batch(self.corpus, config.seed, state.step, config.batch_size, config.block_size)
        start = time.perf_counter()
        with torch.no_grad():
            teacher_logits = self.teacher(x)
        loss, kl, lm = distill_loss(self.model(x), teacher_logits, y, self.alpha, self.temperature)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        self.optimizer.step()
        state.train_seconds += time.perf_counter() - start
        state.tokens += x.numel()
        self.last = (kl, lm)
        return loss.item()
