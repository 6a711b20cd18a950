"""An EAGLE-style draft head: one small decoder layer on the target's own last hidden state.

EAGLE (Li et al., 2024, arXiv 2401.15077) drafts from features rather than tokens: at position
i the head reads the target's final hidden state h_i (what the target's LM head read to choose
x_{i+1}) fused with the embedding of x_{i+1}, and predicts x_{i+2} together with a feature that
stands in for h_{i+1}; the next draft round feeds that feature back. The hidden state already
holds most of what the target knows about the next token, so one layer goes a long way.

Two choices keep it cheap on a CPU:
- A reduced output vocabulary (FR-Spec, arXiv 2502.14856; EAGLE-3's draft vocabulary): the
  head scores only the `draft_vocab` tokens the target emits most often, and `d2t` maps each
  back to the target's id. SmolLM2's full tied head is 49,152 x 576; 8,192 rows cost a sixth.
- No KV cache of its own. The layer's attention is causal over a band of `window` positions
  (no positional encoding: order comes from the mask), and the engine keeps each sequence's
  last `window` target hidden states (window x dim floats, 9 KiB for SmolLM2 at window 4)
  and recomputes the band every draft round: at most window + k rows of a 4M-parameter
  layer, against pool blocks that would have to be allocated, trimmed and counted.
The token embedding is the target's own (not stored here); `d2t` is.
Saved as a directory: config.json (EagleConfig, "architecture": "kvlab-eagle-head") and
model.safetensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.errors import KvlabError
from kvlab.nn.norms import RMSNorm

ARCHITECTURE = "kvlab-eagle-head"


class HeadMismatch(KvlabError):
    """The head was trained for another target (hidden size, vocabulary or model)."""


@dataclass(frozen=True)
class EagleConfig:
    target: str  # the target's name (ModelConfig.name)
    dim: int  # the target's hidden size: the head's width
    target_vocab: int
    draft_vocab: int
    n_heads: int = 4
    head_dim: int = 64
    ffn: int = 1024
    window: int = 4  # positions the head's attention sees, itself included
    norm_eps: float = 1e-5

    def param_count(self) -> int:
        d, a = self.dim, self.n_heads * self.head_dim
        return 2 * d * d + 4 * d * a + 3 * d * self.ffn + d * self.draft_vocab + 3 * d

    def check_target(self, config) -> None:
        """One line when `config` (a target's ModelConfig) is not what this head was trained on."""
        if (config.dim, config.vocab_size) != (self.dim, self.target_vocab):
            raise HeadMismatch(f"the draft head was trained for a target with hidden size {self.dim} and vocabulary "
                               f"{self.target_vocab}; {config.name} has {config.dim} and {config.vocab_size}")


def band_mask(length: int, window: int) -> torch.Tensor:
    """[length, length] bool, True where query i may read key j: i - window < j <= i."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return (j <= i) & (j > i - window)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, d2t: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.config = c = config
        inner = c.n_heads * c.head_dim
        self.fc = nn.Linear(2 * c.dim, c.dim, bias=False)  # [embedding of x_{i+1}, h_i] -> the layer's input
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.qkv = nn.Linear(c.dim, 3 * inner, bias=False)
        self.o = nn.Linear(inner, c.dim, bias=False)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
        self.gate_up = nn.Linear(c.dim, 2 * c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)
        self.out_norm = RMSNorm(c.dim, c.norm_eps)  # the feature the head outputs stands in for the target's h
        self.lm_head = nn.Linear(c.dim, c.draft_vocab, bias=False)
        ids = d2t if d2t is not None else torch.arange(c.draft_vocab)
        self.register_buffer("d2t", ids.to(torch.int64).clone(), persistent=True)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded, hidden [B, T, dim] (x_{i+1}'s embedding and h_i) -> (features [B, T, dim] standing
        for h_{i+1}, logits [B, T, draft_vocab] for x_{i+2})."""
        c = self.config
        x = self.fc(torch.cat([embedded, hidden], dim=-1))
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, c.n_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(t, c.window))
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        features = self.out_norm(x)
        return features, self.lm_head(features)

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


def save_head(head: EagleHead, directory: str, extra: Optional[dict] = None) -> None:
    """config.json and model.safetensors into `directory` (created; files written atomically)."""
    from safetensors.torch import save

    from kvlab.files import write_atomic
    path = Path(directory)
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    write_atomic(path / "model.safetensors", save(tensors))
    meta = {"architecture": ARCHITECTURE, **asdict(head.config), **(extra or {})}
    write_atomic(path / "config.json", json.dumps(meta, indent=2, default=str) + "\n")


def load_head(directory: str, target_config=None) -> EagleHead:
    """The head saved in `directory`; with `target_config`, refused in one line (HeadMismatch) if it
    was trained for a different target."""
    from safetensors.torch import load_file
    path = Path(os.path.expanduser(directory))
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise HeadMismatch(f"{directory} is not a draft head directory ({type(error).__name__})") from None
    if meta.get("architecture") != ARCHITECTURE:
        raise HeadMismatch(f"{directory} is not a kvlab EAGLE head (config.json architecture "
                           f"{meta.get('architecture')!r})")
    config = EagleConfig(**{k: meta[k] for k in EagleConfig.__dataclass_fields__})
    if target_config is not None:
        config.check_target(target_config)
    head = EagleHead(config)
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.eval()


__all__ = ["EagleConfig", "EagleHead", "HeadMismatch", "band_mask", "save_head", "load_head"]
