"""What every built-in draft head shares: a reduced output vocabulary with its map back to the
target's ids, the one-line refusal of a head trained for another target, and its directory.

A head (kvlab.nn.eagle, kvlab.nn.medusa) reads the target's own final hidden states and scores
only `draft_vocab` tokens, the target's most frequent choices (FR-Spec, arXiv 2502.14856; EAGLE-3's
draft vocabulary; chosen by kvlab.draft.features.draft_vocabulary). `d2t` maps a draft index to
the target's id; SmolLM2's full tied head is 49,152 x 576, 8,192 rows cost a sixth of it.

A head directory holds config.json (the head's config, "architecture" naming its kind, and what
training recorded under "kvlab_train") and model.safetensors; `load_draft_head` reads either kind.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from kvlab.errors import KvlabError


class HeadMismatch(KvlabError):
    """The head was trained for another target (hidden size, vocabulary or model), or is no head."""


def check_target(dim: int, target_vocab: int, config) -> None:
    """One line when `config` (a target's ModelConfig) is not what a head of (dim, target_vocab) was trained on."""
    if (config.dim, config.vocab_size) != (dim, target_vocab):
        raise HeadMismatch(f"the draft head was trained for a target with hidden size {dim} and vocabulary "
                           f"{target_vocab}; {config.name} has {config.dim} and {config.vocab_size}")


class ReducedVocab(nn.Module):
    """The `d2t` buffer and the maps between a head's draft vocabulary and the target's."""

    def _register_map(self, draft_vocab: int, d2t: Optional[torch.Tensor]) -> None:
        ids = d2t if d2t is not None else torch.arange(draft_vocab)
        self.register_buffer("d2t", ids.to(torch.int64).clone(), persistent=True)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids]

    def t2d(self) -> torch.Tensor:
        """[target_vocab] int64: each target id's draft index, -1 for ids outside the draft vocabulary."""
        out = torch.full((self.config.target_vocab,), -1, dtype=torch.int64)
        out[self.d2t] = torch.arange(self.config.draft_vocab)
        return out

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., draft_vocab] scattered into the target's vocabulary (-inf elsewhere)."""
        out = torch.full((*logits.shape[:-1], self.config.target_vocab), float("-inf"), dtype=logits.dtype)
        out[..., self.d2t] = logits
        return out


def save_head(head: nn.Module, directory: str, extra: Optional[dict] = None) -> None:
    """config.json and model.safetensors into `directory` (created; files written atomically)."""
    from safetensors.torch import save

    from kvlab.files import write_atomic
    path = Path(directory)
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    write_atomic(path / "model.safetensors", save(tensors))
    meta = {"architecture": head.ARCHITECTURE, **asdict(head.config), "param_count": head.config.param_count(),
            **(extra or {})}  # param_count: what `kvlab plan --draft HEAD` reads (kvlab.plan.draft_heads)
    write_atomic(path / "config.json", json.dumps(meta, indent=2, default=str) + "\n")


def read_head_config(directory: str) -> dict:
    """A head directory's config.json, refused in one line when it is not a kvlab draft head."""
    path = Path(os.path.expanduser(directory))
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise HeadMismatch(f"{directory} is not a draft head directory ({type(error).__name__})") from None
    if meta.get("architecture") not in head_classes():
        raise HeadMismatch(f"{directory} is not a kvlab draft head (config.json architecture "
                           f"{meta.get('architecture')!r}; known: {', '.join(head_classes())})")
    return meta


def head_classes() -> dict:
    from kvlab.nn.eagle import EagleHead
    from kvlab.nn.medusa import MedusaHead
    return {cls.ARCHITECTURE: cls for cls in (EagleHead, MedusaHead)}


def load_draft_head(directory: str, target_config=None, architecture: Optional[str] = None) -> nn.Module:
    """The head saved in `directory` (EAGLE or Medusa); with `target_config`, refused in one line
    (HeadMismatch) if it was trained for a different target; with `architecture`, if it is another kind."""
    from safetensors.torch import load_file
    meta = read_head_config(directory)
    if architecture is not None and meta["architecture"] != architecture:
        raise HeadMismatch(f"{directory} holds a {meta['architecture']}, not a {architecture}")
    cls = head_classes()[meta["architecture"]]
    config = cls.CONFIG(**{k: meta[k] for k in cls.CONFIG.__dataclass_fields__ if k in meta})
    if target_config is not None:
        check_target(config.dim, config.target_vocab, target_config)
    head = cls(config)
    head.load_state_dict(load_file(str(Path(os.path.expanduser(directory)) / "model.safetensors")))
    return head.eval()


__all__ = ["HeadMismatch", "ReducedVocab", "check_target", "save_head", "read_head_config", "load_draft_head"]
