"""Recover a converted model by distillation from the model it came from.

The student (a KV-head or MLA conversion) learns the teacher's next-token distribution:
loss = alpha x KL(teacher || student) at temperature T (scaled by T^2, Hinton et al.)
+ (1 - alpha) x the language-model loss on the text, plus optionally `hidden_weight` x the
students' hidden states' distance to the teacher's after every block (each layer's mean squared
error over the teacher's mean square). The text is either the user's (`--data`) or the
teacher's own samples, so no pre-training corpus is needed.

Only the attention (and the norms) trains by default: a conversion changed nothing else, the
backward pass then skips every MLP and embedding weight gradient, and a checkpoint holds only
what trains (the frozen weights are the converted directory's). Training is
kvlab.train.loop's Trainer (AdamW, warm-up and cosine, progress bar, atomic resumable
checkpoints) with the step's loss replaced; each step's time is split into the teacher's
forward, the student's forward and backward, and the optimiser, which the report states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from kvlab.plan.errors import PlanError
from kvlab.train.data import train_batch
from kvlab.train.loop import CHECKPOINT_FORMAT, Trainer, lr_at, mean_loss, save_atomic

TRAIN_PARTS = ("attention", "all")
_ATTENTION_PARTS = (".attn.", "attn_norm.", "mlp_norm.", "post_attn_norm.", "post_mlp_norm.")


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


def select_trainable(model: torch.nn.Module, part: str) -> int:
    """Freeze all but `part` ("attention": attention projections and every norm; "all"); the count training."""
    if part not in TRAIN_PARTS:
        raise PlanError(f"--train must be one of {', '.join(TRAIN_PARTS)}, got {part!r}")
    count = 0
    for name, parameter in model.named_parameters():
        train = part == "all" or any(piece in f".{name}" for piece in _ATTENTION_PARTS) or name == "norm.weight"
        parameter.requires_grad_(train)
        count += parameter.numel() if train else 0
    return count


class _BlockOutputs:
    """Forward hooks that keep every block's output of the last forward pass."""

    def __init__(self, model) -> None:
        self.outputs: list[torch.Tensor] = []
        self.active = False  # only the training step's passes are kept
        self.hooks = [block.register_forward_hook(self._keep) for block in model.blocks]

    def _keep(self, module, args, out) -> None:
        if self.active:
            self.outputs.append(out)

    def take(self) -> list[torch.Tensor]:
        outputs, self.outputs = self.outputs, []
        return outputs


def hidden_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers of each layer's squared error over the teacher's mean square."""
    terms = [(s - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12) for s, t in zip(student, teacher)]
    return torch.stack(terms).mean()


class DistillTrainer(Trainer):
    """The Trainer with the distillation loss; validation is the LM loss and the KL on held-out text."""

    def __init__(self, student, teacher, corpus: TokenCorpus, config, checkpoint=None, alpha: float = 1.0,
                 temperature: float = 1.0, hidden_weight: float = 0.0, train: str = "attention",
                 record: Optional[Callable[[dict], None]] = None, **options) -> None:
        """`record(progress)` is called at every checkpoint with the loss-against-tokens record so far."""
        if not 0 <= alpha <= 1 or temperature <= 0 or hidden_weight < 0:
            raise PlanError(f"--alpha must be in [0, 1], --temperature positive and --hidden-weight non-negative, "
                            f"got {alpha}, {temperature}, {hidden_weight}")
        self.teacher, self.alpha, self.temperature = teacher.eval(), alpha, temperature
        self.hidden_weight, self.record = hidden_weight, record
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        self.trainable = select_trainable(student, train)
        self.last: Optional[tuple[float, float]] = None
        self.window: list[tuple[float, float]] = []
        self.timing = {"teacher_s": 0.0, "student_s": 0.0, "optimizer_s": 0.0}
        self._hooks = (_BlockOutputs(student), _BlockOutputs(teacher)) if hidden_weight else None
        super().__init__(student, corpus, config, checkpoint, **options)

    def validation_loss(self) -> float:
        return mean_loss(self.model, self.val_batches)

    @torch.no_grad()
    def validation_kl(self) -> float:
        was_training = self.model.training
        self.model.eval()
        total = count = 0.0
        for x, _ in self.val_batches:
            vocab = self.teacher.config.vocab_size
            s, t = self.model(x).reshape(-1, vocab), self.teacher(x).reshape(-1, vocab)
            total += float(F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum"))
            count += s.shape[0]
        self.model.train(was_training)
        return total / count

    def _step(self) -> float:
        config, state = self.config, self.state
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(state.step, config)
        x, y = train_batch(self.corpus, config.seed, state.step, config.batch_size, config.block_size)
        start = time.perf_counter()
        hooks = self._hooks or ()
        for hook in hooks:
            hook.active = True
        try:
            with torch.no_grad():
                teacher_logits = self.teacher(x)
            middle = time.perf_counter()
            student_logits = self.model(x)
        finally:
            for hook in hooks:
                hook.active = False
        loss, kl, lm = distill_loss(student_logits, teacher_logits, y, self.alpha, self.temperature)
        if self._hooks is not None:
            loss = loss + self.hidden_weight * hidden_loss(self._hooks[0].take(), self._hooks[1].take())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        backward = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], config.grad_clip)
        self.optimizer.step()
        end = time.perf_counter()
        self.timing["teacher_s"] += middle - start
        self.timing["student_s"] += backward - middle
        self.timing["optimizer_s"] += end - backward
        state.train_seconds += end - start
        state.tokens += x.numel()
        self.last = (kl, lm)
        self.window.append((kl, lm))
        return loss.item()

    def _evaluate(self, train_loss: float) -> None:
        super()._evaluate(train_loss)
        entry = self.state.history[-1]
        kl = [k for k, _ in self.window] or [float("nan")]
        lm = [m for _, m in self.window] or [float("nan")]
        entry.update(tokens=self.state.tokens, seconds=round(self.state.train_seconds, 3),
                     train_kl=sum(kl) / len(kl), train_lm=sum(lm) / len(lm), val_kl=self.validation_kl())
        self.window = []

    # -- compact, resumable checkpoints: what trains and its optimiser state, nothing frozen ---------------

    def save(self) -> None:
        if self.checkpoint is None:
            return
        from dataclasses import asdict
        trained = {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}
        save_atomic({"format": CHECKPOINT_FORMAT, "model_config": self._model_config(),
                     "train_config": asdict(self.config), "state": asdict(self.state), "trained": trained,
                     "optimizer": self.optimizer.state_dict(), "timing": dict(self.timing)}, self.checkpoint)
        if self.record is not None:
            self.record({"steps": self.state.step, "of_steps": self.config.steps, "tokens": self.state.tokens,
                         "train_seconds": round(self.state.train_seconds, 1), "timing": dict(self.timing),
                         "record": self.state.history})

    def _resume(self) -> None:
        from dataclasses import asdict

        from kvlab.train.loop import TrainState
        saved = torch.load(self.checkpoint, map_location="cpu", weights_only=False)
        if saved.get("format") != CHECKPOINT_FORMAT or "trained" not in saved:
            raise PlanError(f"{self.checkpoint} is not a kvlab uptraining checkpoint; delete it to start over")
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        if (saved["train_config"] != asdict(self.config) or saved["model_config"] != self._model_config()
                or set(saved["trained"]) != trainable):
            raise PlanError(f"{self.checkpoint} was written for a different model or training set-up; "
                            "delete it or train in another folder")
        with torch.no_grad():
            parameters = dict(self.model.named_parameters())
            for name, tensor in saved["trained"].items():
                parameters[name].copy_(tensor)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["state"])
        self.timing.update(saved.get("timing", {}))
