"""A Medusa-style head set: k small heads on the target's last hidden state, head j guessing token t+1+j.

Medusa (Cai et al., 2024, arXiv 2401.10774): the target's LM head reads h_t and chooses x_{t+1};
head j (j = 1..k) reads the same h_t through a residual block, h + SiLU(W_j h + b_j), and guesses
x_{t+1+j}, all k at once. No recurrence and no K/V: a draft round is one batched product for
every drafting sequence, whatever k is, so it is the cheapest proposer that reads features. Its
guesses do not see each other (head 2 cannot know what head 1 guessed), which is why its
acceptance falls faster with depth than EAGLE's.

Two choices keep it cheap on a CPU, and they differ from the paper's:
- One LM head shared by the k heads, over the reduced draft vocabulary (kvlab.nn.draft_head) and
  frozen at the target's own (tied) rows for it: the k rows of a round go through it as one
  [k, dim] x [dim, draft_vocab] product, reading its bytes once instead of k times. The paper
  trains a full-vocabulary LM head per Medusa head (k x 28M parameters for SmolLM2).
- The residual blocks start at zero, so before training every head guesses x_{t+1}: the
  target's own choice, a defined starting point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.nn.draft_head import ReducedVocab, check_target, load_draft_head

ARCHITECTURE = "kvlab-medusa-head"


@dataclass(frozen=True)
class MedusaConfig:
    target: str  # the target's name (ModelConfig.name)
    dim: int  # the target's hidden size
    target_vocab: int
    draft_vocab: int
    num_heads: int = 3  # k: the most tokens a round can draft
    num_layers: int = 1  # residual blocks per head
    norm_eps: float = 1e-5  # kept for symmetry with the EAGLE head's config (unused: no norm here)

    def param_count(self) -> int:
        """Stored parameters: the blocks and the shared LM head (the d2t map is not a parameter)."""
        d = self.dim
        return self.num_heads * self.num_layers * (d * d + d) + d * self.draft_vocab

    def check_target(self, config) -> None:
        check_target(self.dim, self.target_vocab, config)


class MedusaHead(ReducedVocab):
    ARCHITECTURE = ARCHITECTURE
    CONFIG = MedusaConfig

    def __init__(self, config: MedusaConfig, d2t: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.config = c = config
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(c.dim, c.dim) for _ in range(c.num_layers))
                                    for _ in range(c.num_heads))
        for head in self.blocks:
            for layer in head:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.lm_head = nn.Linear(c.dim, c.draft_vocab, bias=False)
        self._register_map(c.draft_vocab, d2t)

    def features(self, hidden: torch.Tensor, heads: Optional[int] = None) -> torch.Tensor:
        """hidden [..., dim] (the target's h_t) -> [..., heads, dim]: each head's residual stream."""
        out = []
        for layers in self.blocks[:heads or self.config.num_heads]:
            x = hidden
            for layer in layers:
                x = x + F.silu(layer(x))
            out.append(x)
        return torch.stack(out, dim=-2)

    def forward(self, hidden: torch.Tensor, heads: Optional[int] = None) -> torch.Tensor:
        """hidden [..., dim] -> logits [..., heads, draft_vocab]: head j's guess for x_{t+1+j}."""
        z = self.features(hidden, heads)
        return self.lm_head(z.reshape(-1, z.shape[-1])).reshape(*z.shape[:-1], -1)


def load_medusa(directory: str, target_config=None) -> MedusaHead:
    """The Medusa head set saved in `directory`; refused in one line if it was trained for another target."""
    return load_draft_head(directory, target_config, ARCHITECTURE)


__all__ = ["MedusaConfig", "MedusaHead", "load_medusa"]
