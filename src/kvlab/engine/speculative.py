"""Speculative decoding: a cheap proposer drafts k tokens, the target checks them in one pass.

The acceptance rule is Leviathan, Kalman and Matias (2022), written as the paper states it,
and it leaves the target's output distribution exactly unchanged:
  for each drafted token x_i, drawn from the draft's q_i:
      accept it with probability min(1, p_i(x_i) / q_i(x_i));
      on the first rejection, draw from norm(max(0, p_i - q_i)) instead, and stop;
  if all k are accepted, draw a bonus token from p_{k+1}.
At temperature 0 both distributions are one-hot, and this is "accept while the target's argmax
agrees, then take the target's argmax": greedy output with speculation equals greedy output
without it. A deterministic proposer (n-gram lookup) has a one-hot q.

Proposers (vLLM's `speculative_config` names):
- "ngram": prompt lookup. The longest suffix of the sequence (between prompt_lookup_max and
  prompt_lookup_min tokens) that occurred earlier is matched, and the tokens that followed
  it are proposed. No model, no KV.
- "self": the target's own first `num_layers` layers, then its final norm and LM head. Their
  K/V at the drafted positions are exactly what the target's first layers write there during
  verification, so the self-draft needs no cache of its own.
- "draft_model": a separate model sharing the tokenizer, with its own pool of the same
  blocks: one block table addresses both, so the pool's bytes per block count both caches.
- "eagle": an EAGLE head (kvlab.nn.eagle, trained by `kvlab draft train --method eagle`) on the
  target's own final hidden states, drafting from a reduced vocabulary mapped back to the
  target's ids (kvlab.engine.eagle_proposer). It keeps no K/V: each sequence holds its last
  `window` hidden states, and the head recomputes that band every round.
- "medusa": a Medusa head set (kvlab.nn.medusa, `kvlab draft train --method medusa`): k heads on
  the target's last hidden state guess the next k tokens in one pass (kvlab.engine.medusa_proposer);
  no K/V, one hidden state per sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import SamplingParams, draw, filtered_logits

METHODS = ("ngram", "self", "draft_model", "eagle", "medusa")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Optional[str] = None
    num_layers: Optional[int] = None  # self-draft depth (default: a quarter of the target's layers)
    # vLLM's: no drafts in a step whose batch holds at least this many sequences (where verifying
    # extra rows costs more than the accepted tokens save; kvlab.bench.speculative says where)
    disable_by_batch_size: Optional[int] = None

    @classmethod
    def parse(cls, value: Union[str, dict, "SpeculativeConfig", None]) -> Optional["SpeculativeConfig"]:
        """From `--speculative-config`'s JSON text or `LLM(speculative_config=...)`'s dict."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise RequestError(f"--speculative-config is not JSON: {error.msg}", "speculative_config") from None
        if not isinstance(value, dict):
            raise RequestError("--speculative-config must be a JSON object", "speculative_config")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise RequestError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}",
                               "speculative_config")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise RequestError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}",
                               "speculative_config")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise RequestError("num_speculative_tokens must be an integer from 1 to 16", "speculative_config")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise RequestError("disable_by_batch_size must be a positive integer", "speculative_config")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise RequestError("need 1 <= prompt_lookup_min <= prompt_lookup_max", "speculative_config")
        if self.method in ("draft_model", "eagle", "medusa") and not self.model:
            raise RequestError(f'the "{self.method}" method needs "model": a path or name', "speculative_config")


def ngram_proposal(ids: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's longest matching suffix."""
    n = len(ids)
    for size in range(min(high, n - 1), low - 1, -1):
        suffix = list(ids[n - size:])
        for start in range(n - size - 1, -1, -1):  # the most recent earlier occurrence
            if list(ids[start:start + size]) == suffix:
                return list(ids[start + size:start + size + k])
    return []


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from (temperature, top_k/p, min_p applied), rows [T, V]."""
    return torch.stack([torch.softmax(filtered_logits(row, params), dim=-1) for row in logits])


def accept(drafts: Sequence[int], p: torch.Tensor, q: Optional[torch.Tensor], params: SamplingParams,
           generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """The tokens to emit and how many drafts were accepted.

    drafts [k]; p [k+1, V] the target's distributions at each drafted position and one past
    them; q [k, V] the draft's (None: a deterministic proposer, one-hot on each draft).
    Greedy requests compare argmaxes (p and q are not needed as probabilities).
    """
    k = len(drafts)
    if params.greedy:
        best = p.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == best[accepted]:
            accepted += 1
        return list(drafts[:accepted]) + [best[accepted]], accepted
    out = []
    for i, x in enumerate(drafts):
        q_x = 1.0 if q is None else float(q[i, x])
        ratio = float(p[i, x]) / q_x if q_x > 0 else 0.0
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            out.append(x)
            continue
        one_hot = torch.zeros_like(p[i])
        one_hot[x] = 1.0
        residual = (p[i] - (one_hot if q is None else q[i])).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: the rejection had probability 0; keep p
            residual = p[i]
        out.append(draw(residual[None], generator)[0])
        return out, i
    out.append(draw(p[k][None], generator)[0])  # all accepted: the bonus token
    return out, k


@dataclass
class SpecStats:
    """vLLM's definitions: acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or []

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_position) < drafted:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
