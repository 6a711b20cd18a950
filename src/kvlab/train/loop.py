"""The training loop: AdamW, warm-up then cosine, gradient clipping, periodic validation,
a progress bar, and checkpoints that a killed run resumes from.

Everything a step depends on is either in the checkpoint (weights, AdamW moments, step,
history) or a pure function of the step (learning rate, batch), so resuming from step k
gives the same weights as never stopping. Checkpoints are written to a temporary file in
the same folder and renamed over the old one (kvlab.files.write_atomic): a kill mid-write
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from kvlab.files import write_atomic
from kvlab.plan.errors import PlanError
from kvlab.train.data import CharCorpus, eval_batches, tiled_windows, train_batch
from kvlab.train.progress import progress_bar

CHECKPOINT_FORMAT = "kvlab-train-1"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one run (nanoGPT's shakespeare_char recipe, scaled by the caller)."""

    steps: int
    batch_size: int
    block_size: int
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    seed: int = 0  # data order: batch k is a function of (seed, k) alone

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "block_size", "eval_every", "eval_batches", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup < 0 or not 0 < self.min_lr <= self.lr:
            raise PlanError(f"need warmup >= 0 and 0 < min_lr <= lr, got {self.warmup}, {self.min_lr}, {self.lr}")


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `lr` down to `min_lr` at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class TrainState:
    """What a run has done so far; saved in every checkpoint."""

    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0  # optimiser steps only, evaluation excluded
    history: list = field(default_factory=list)  # {step, lr, train_loss, val_loss}

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else 0.0

    @property
    def last_val_loss(self) -> Optional[float]:
        return self.history[-1]["val_loss"] if self.history else None


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (nanoGPT): not on norms, biases or 1-D gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def loss_on(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches) -> float:
    """Token-weighted mean cross-entropy over `batches` (nats per character)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        total += float(loss_on(model, x, y)) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


def validation_loss(model: torch.nn.Module, corpus: CharCorpus, block_size: int, batch_size: int = 32,
                    max_tokens: Optional[int] = None) -> float:
    """Loss over the whole validation split in non-overlapping `block_size` windows."""
    return mean_loss(model, tiled_windows(corpus.val, block_size, batch_size, max_tokens))


def save_atomic(obj: dict, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename it over `path`."""
    write_atomic(path, lambda handle: torch.save(obj, handle))


class Trainer:
    """Trains `model` on `corpus`; with `checkpoint` set, resumes from it and keeps it current.

    What a batch is and what it costs are four methods (`train_batch`, `batch_loss`,
    `batch_tokens`, `validation_batches`): next-character cross-entropy on a CharCorpus here;
    a subclass swaps them for another objective (kvlab.draft.distill) and keeps the loop,
    the schedule, the checkpoints and resuming as they are.
    """

    def __init__(self, model: torch.nn.Module, corpus: CharCorpus, config: TrainConfig,
                 checkpoint: Optional[Path] = None, progress: bool = True, label: str = "train",
                 log: Optional[Callable[[str], None]] = None):
        self.model, self.corpus, self.config = model, corpus, config
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.progress, self.label, self.log = progress, label, log
        self.optimizer = make_optimizer(model, config)
        self.state = TrainState()
        self.val_batches = self.validation_batches()
        if self.checkpoint is not None and self.checkpoint.exists():
            self._resume()

    @property
    def done(self) -> bool:
        return self.state.step >= self.config.steps

    # -- the objective (overridden by subclasses) ------------------------------------------------

    def train_batch(self, step: int):
        """Step `step`'s batch: a pure function of (seed, step), so a resumed run draws the same ones."""
        config = self.config
        return train_batch(self.corpus, config.seed, step, config.batch_size, config.block_size)

    def batch_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return loss_on(self.model, x, y)

    def batch_tokens(self, batch) -> int:
        return int(batch[0].numel())

    def validation_batches(self) -> list:
        config = self.config
        return eval_batches(self.corpus.val, config.eval_batches, config.batch_size, config.block_size)

    def validation_loss(self) -> float:
        return mean_loss(self.model, self.val_batches)

    # -- the loop ----------------------------------------------------------------------------------

    def fit(self, stop_after: Optional[int] = None, max_seconds: Optional[float] = None) -> TrainState:
        """Train to `config.steps` (or stop once `stop_after` steps are done, as a kill would).

        `max_seconds` ends the run early, after a checkpoint, once that much wall time has
        passed: a long training run in slices that each fit a time budget.
        """
        config, state = self.config, self.state
        end = config.steps if stop_after is None else min(config.steps, stop_after)
        self.model.train()
        bar = self._bar(end)
        window: list[float] = []
        started = time.monotonic()
        while state.step < end:
            loss = self._step()
            window.append(loss)
            state.step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{state.tokens_per_s:,.0f}", refresh=False)
            if state.step % config.eval_every == 0 or state.step == config.steps:
                self._evaluate(sum(window) / len(window))
                window = []
            out_of_time = max_seconds is not None and time.monotonic() - started > max_seconds
            if state.step % config.checkpoint_every == 0 or state.step == end or out_of_time:
                self.save()
            if out_of_time:
                break
        if bar is not None:
            bar.close()
        self.model.eval()
        return state

    def _step(self) -> float:
        config, state = self.config, self.state
        lr = lr_at(state.step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.train_batch(state.step)
        start = time.perf_counter()
        loss = self.batch_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        self.optimizer.step()
        state.train_seconds += time.perf_counter() - start
        state.tokens += self.batch_tokens(batch)
        return loss.item()

    def _evaluate(self, train_loss: float) -> None:
        state = self.state
        val = self.validation_loss()
        state.history.append({"step": state.step, "lr": lr_at(state.step - 1, self.config),
                              "train_loss": train_loss, "val_loss": val})
        if self.log is not None:
            self.log(f"{self.label}: step {state.step}/{self.config.steps} train {train_loss:.4f} "
                     f"val {val:.4f} {state.tokens_per_s:,.0f} tok/s")

    def save(self) -> None:
        if self.checkpoint is None:
            return
        save_atomic({
            "format": CHECKPOINT_FORMAT,
            "model_config": self._model_config(),
            "train_config": asdict(self.config),
            "state": asdict(self.state),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }, self.checkpoint)

    def _resume(self) -> None:
        saved = torch.load(self.checkpoint, map_location="cpu", weights_only=False)
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise PlanError(f"{self.checkpoint} is not a kvlab training checkpoint")
        if saved["train_config"] != asdict(self.config) or saved["model_config"] != self._model_config():
            raise PlanError(f"{self.checkpoint} was written for a different model or training set-up; "
                            "delete it or train in another folder")
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["state"])

    def _model_config(self) -> Optional[dict]:
        config = getattr(self.model, "config", None)
        return config.to_dict() if hasattr(config, "to_dict") else None

    def _bar(self, end: int):
        enabled = self.progress and self.state.step < end
        return progress_bar(end, self.label, initial=self.state.step, enabled=enabled, unit="step")
