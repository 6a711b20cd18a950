"""The training loop every built-in draft head shares (kvlab.draft.eagle_train, kvlab.draft.medusa_train).

AdamW on the head's trainable parameters (its LM head, the target's own rows, stays frozen),
a cosine schedule to a tenth of the peak, a batch that is a function of (seed, step) so a resumed
run trains on what an uninterrupted one would, an atomic checkpoint at every evaluation and at
the end, a progress bar, and two budgets: steps or trained positions, and wall-clock seconds.
A head kind supplies its batch, its losses and its held-out evaluation.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from kvlab.train.loop import save_atomic


class HeadTrainer:
    FORMAT = "kvlab-head-checkpoint-1"  # each kind names its own, so one never resumes the other's
    LABEL = "draft head"

    def __init__(self, head, cfg, checkpoint: Path, log: Callable[[str], None] = lambda s: None,
                 progress: bool = True) -> None:
        self.head, self.cfg, self.checkpoint, self.log, self.progress = head, cfg, checkpoint, log, progress
        head.lm_head.weight.requires_grad_(False)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.t2d = head.t2d()
        self.step, self.tokens, self.seconds, self.history = 0, 0, 0.0, []
        if checkpoint.exists():
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)
            if state.get("format") == self.FORMAT:
                head.load_state_dict(state["head"])
                self.opt.load_state_dict(state["optimizer"])
                self.step, self.tokens, self.seconds = state["step"], state["tokens"], state["seconds"]
                self.history = state["history"]
                log(f"resumed at step {self.step} ({self.tokens:,} positions)")

    # -- what a head kind supplies ---------------------------------------------------------------
    def batch(self, rng: random.Random):
        raise NotImplementedError

    def losses(self, batch) -> dict:
        """{"loss": tensor, "positions": int, "agree1": tensor (shown on the bar), ...}"""
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    def describe(self, metrics: dict) -> str:
        return f"val agreement {metrics['agree1']:.3f}"

    # -- the loop ------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        c = self.cfg
        return self.step >= c.steps or (c.token_budget is not None and self.tokens >= c.token_budget)

    def save(self) -> None:
        save_atomic({"format": self.FORMAT, "head": self.head.state_dict(), "optimizer": self.opt.state_dict(),
                     "step": self.step, "tokens": self.tokens, "seconds": self.seconds, "history": self.history,
                     "config": asdict(self.cfg), "head_config": asdict(self.head.config)}, self.checkpoint)

    def fit(self, max_seconds: Optional[float] = None, stop_after: Optional[int] = None) -> None:
        from kvlab.train.progress import progress_bar
        cfg = self.cfg
        started = time.monotonic()
        bar = progress_bar(cfg.steps, self.LABEL, initial=self.step, unit="step", enabled=self.progress)
        self.head.train()
        while not self.done and (stop_after is None or self.step < stop_after):
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                self.log("time budget spent; run again to continue")
                break
            t0 = time.monotonic()
            lr = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, self.step / max(1, cfg.steps)))))
            for group in self.opt.param_groups:
                group["lr"] = lr
            out = self.losses(self.batch(random.Random(cfg.seed * 1_000_003 + self.step)))
            self.opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.step += 1
            self.tokens += out["positions"]
            self.seconds += time.monotonic() - t0
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(out['loss'].detach()):.3f}", agree=f"{float(out['agree1']):.2f}")
            if self.step % cfg.eval_every == 0 or self.done:
                metrics = self.evaluate()
                self.history.append({"step": self.step, "tokens": self.tokens,
                                     "train_loss": round(float(out["loss"].detach()), 4),
                                     **{f"val_{k}": v for k, v in metrics.items()}})
                self.log(f"step {self.step}: {self.describe(metrics)}")
                self.save()
        if bar is not None:
            bar.close()
        self.save()


__all__ = ["HeadTrainer"]
