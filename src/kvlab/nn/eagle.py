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
The token embedding is the target's own (not stored here); `d2t` is (kvlab.nn.draft_head: the
map, the refusal of another target's head, the directory: config.json with "architecture":
"kvlab-eagle-head", and model.safetensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.nn.draft_head import HeadMismatch, ReducedVocab, check_target, load_draft_head, save_head
from kvlab.nn.norms import RMSNorm

ARCHITECTURE = "kvlab-eagle-head"


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
        check_target(self.dim, self.target_vocab, config)


def band_mask(length: int, window: int) -> torch.Tensor:
    """[length, length] bool, True where query i may read key j: i - window < j <= i."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return (j <= i) & (j > i - window)


class EagleHead(ReducedVocab):
    ARCHITECTURE = ARCHITECTURE
    CONFIG = EagleConfig

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
        self._register_map(c.draft_vocab, d2t)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded, hidden [B, T, dim] (x_{i+1}'s embedding and h_i) -> (features [B, T, dim] standing
        for h_{i+1}, logits [B, T, draft_vocab] for x_{i+2}).

        `last_only`: the last position's alone ([B, 1, ...]), what a draft round reads. The other rows
        enter only as the keys and values its band reads, so their output projection, MLP and LM head
        (three quarters of a round's work at window 4) are skipped; the figures equal the full pass's
        last row."""
        x, q, k, v = self.inputs(embedded, hidden)
        if last_only:
            return self.last(x[:, -1:], q[:, :, -1:], k, v)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(x.shape[1], self.config.window))
        return self._after_attention(x, attended)

    def inputs(self, embedded: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each position's own part of a pass, which no other position changes: the fused input x [B, T, dim]
        and its query, key and value [B, heads, T, head_dim]. A proposer keeps them for positions it has
        seen (kvlab.engine.eagle_proposer) and computes only the new ones."""
        c = self.config
        x = self.fc(torch.cat([embedded, hidden], dim=-1))
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, c.n_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        return x, q, k, v

    def last(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position (x [B, 1, dim], q [B, heads, 1, head_dim]) over the keys and values of the positions
        up to it (the last `window` of k, v [B, heads, T, head_dim] are read): (feature, logits) [B, 1, ...]."""
        w = self.config.window
        return self._after_attention(x, F.scaled_dot_product_attention(q, k[:, :, -w:], v[:, :, -w:]))

    def _after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        features = self.out_norm(x)
        return features, self.lm_head(features)


def load_head(directory: str, target_config=None) -> EagleHead:
    """The EAGLE head saved in `directory`; with `target_config`, refused in one line (HeadMismatch) if it
    was trained for a different target."""
    return load_draft_head(directory, target_config, ARCHITECTURE)


__all__ = ["EagleConfig", "EagleHead", "HeadMismatch", "band_mask", "save_head", "load_head"]
