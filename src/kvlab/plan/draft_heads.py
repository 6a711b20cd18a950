"""A built-in draft head (EAGLE or Medusa, kvlab.nn.eagle / kvlab.nn.medusa) as the planner sees it,
read from its directory's config.json with the standard library.

A head keeps no K/V, so it takes no room in the pool; what it costs is its weights (read once per
draft pass at batch 1) and, per running sequence, the last `window` final hidden states the engine
keeps for it in fp32 outside the pool (EAGLE: `window` of them, 4 by default; Medusa: one). An
EAGLE head drafts k tokens in k passes of its one layer; a Medusa head set drafts them in one pass
of k residual blocks and its shared LM head. Its acceptance rate, when not given, is what training
recorded: the held-out greedy agreement of its first draft position (`kvlab draft train`'s
"held_out_agreement", or "validation" -> "chat" -> "agree1" in heads written before it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvlab.plan.errors import PlanError

ARCHITECTURES = {"kvlab-eagle-head": "eagle", "kvlab-medusa-head": "medusa"}
STATE_BYTES = 4  # the engine keeps the hidden states in fp32


@dataclass(frozen=True)
class DraftHead:
    kind: str  # "eagle" or "medusa"
    name: str  # the directory's name
    target: str
    dim: int
    target_vocab: int
    draft_vocab: int
    params: int  # stored parameters
    window: int  # hidden states kept per running sequence
    num_heads: Optional[int] = None  # Medusa: the most tokens a pass drafts
    num_layers: int = 1  # Medusa: residual blocks per head
    held_out_agreement: Optional[float] = None

    @property
    def label(self) -> str:
        return f"{self.name} ({'EAGLE head' if self.kind == 'eagle' else f'Medusa, {self.num_heads} heads'})"

    def passes(self, k: int) -> int:
        """Head passes per step drafting k tokens."""
        return k if self.kind == "eagle" else 1

    def params_per_pass(self, k: int) -> int:
        """Parameters one pass reads: all of an EAGLE head; k of a Medusa set's blocks and its shared LM head."""
        if self.kind == "eagle":
            return self.params
        self.check_k(k)
        return self.params - (self.num_heads - k) * self.num_layers * (self.dim * self.dim + self.dim)

    def state_bytes_per_sequence(self) -> int:
        return self.window * self.dim * STATE_BYTES

    def check_k(self, k: int) -> None:
        if self.kind == "medusa" and k > self.num_heads:
            raise PlanError(f"--num-speculative-tokens {k}: the Medusa head set {self.name} has {self.num_heads} heads")

    def check_target(self, hidden_size: Optional[int], vocab_size: Optional[int], name: str) -> None:
        """One line when the target's shape (where known) is not the one the head was trained for."""
        if (hidden_size, vocab_size) != (self.dim, self.target_vocab) and None not in (hidden_size, vocab_size):
            raise PlanError(f"the draft head {self.name} was trained for a target with hidden size {self.dim} and "
                            f"vocabulary {self.target_vocab}; {name} has {hidden_size} and {vocab_size}")


def read_draft_head(path: str) -> Optional[DraftHead]:
    """The head in directory `path`, or None when `path` is not a kvlab draft head (a model to load instead)."""
    directory = Path(os.path.expanduser(path))
    try:
        meta = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = ARCHITECTURES.get(meta.get("architecture")) if isinstance(meta, dict) else None
    if kind is None:
        return None
    train = meta.get("kvlab_train") or {}
    params = meta.get("param_count", train.get("params"))
    agreement = train.get("held_out_agreement", ((train.get("validation") or {}).get("chat") or {}).get("agree1"))
    try:
        return DraftHead(kind, directory.name, str(meta["target"]), int(meta["dim"]), int(meta["target_vocab"]),
                         int(meta["draft_vocab"]), int(params), int(meta.get("window", 1)),
                         int(meta["num_heads"]) if kind == "medusa" else None, int(meta.get("num_layers", 1)),
                         None if agreement is None else float(agreement))
    except (KeyError, TypeError, ValueError) as error:
        raise PlanError(f"{path}: the draft head's config.json lacks {error} (its parameter count or shape)") from None


__all__ = ["DraftHead", "read_draft_head"]
