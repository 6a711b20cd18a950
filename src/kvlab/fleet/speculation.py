"""Speculative decoding in the simulated replica: what a step costs and how many tokens each sequence emits.

Memory is the planner's (kvlab.plan.speculative: every block holds the target's and the draft's
K/V, so the pool has fewer blocks) and the lookahead is the engine's (the scheduler reserves
1 + k slots per decode; kvlab.engine.scheduler.draft_budget says how many drafts fit them).

Time of one step with speculation (SpecStep.seconds):
- the target runs one pass in which each drafting sequence feeds [last token, d drafts], priced
  as a prompt chunk of 1 + d tokens at its context (the step cost's prefill terms), beside the
  step's real prompt chunks and any plain decodes;
- the draft runs max(d) rounds; round r is a decode step of the sequences with d > r at context
  c + r, priced by the draft's own step cost. The draft also reads every prompt chunk the target
  reads (its catch-up), in round 0 (or in a pass of its own if no one drafts this step).
  With the roofline, the draft's cost is the same roofline, efficiencies and per-step overhead
  applied to the draft's weights, KV bytes and FLOPs per rank; with a calibration, it is the
  calibrated step cost scaled by the planner's cost ratio (draft / target weight bytes read).

Tokens (Leviathan, Kalman and Matias, 2022): each drafted token is accepted with probability a,
independently, until the first rejection; the accepted run of d drafts is min(G, d) for G
geometric (P(G >= j) = a^j), and the target adds one token of its own, so a step emits
min(G, d) + 1 tokens, (1 - a^(k+1)) / (1 - a) on average when d = k. G is drawn from a
counter-based generator keyed by (seed, request, output position): the same request at the
same point of its answer draws the same run in either simulator, whatever the batch around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from kvlab.fleet.step_cost import LinearCost, RooflineCost, chunk_pairs
from kvlab.plan.speculative import check_speculation, expected_tokens_per_step

MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood, 2014): a 64-bit counter to a well-mixed 64-bit word."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class ScaledCost:
    """Another step cost times a constant: the draft's price under a calibration of the target."""

    base: Union[RooflineCost, LinearCost]
    ratio: float
    kind: str = "scaled"

    def seconds(self, decode_seqs: int, decode_ctx: int, prefill_tokens: int, prefill_pairs: int,
                prefill_kv: int) -> float:
        return self.ratio * self.base.seconds(decode_seqs, decode_ctx, prefill_tokens, prefill_pairs, prefill_kv)

    def describe(self) -> dict:
        return {"kind": self.kind, "ratio": self.ratio, "of": "the calibrated target step cost"}


@dataclass(frozen=True)
class Speculation:
    """A replica's draft model: k drafted tokens per decode, acceptance rate a, the draft's step cost."""

    draft: str
    acceptance_rate: float
    num_speculative_tokens: int
    draft_cost: Union[RooflineCost, LinearCost, ScaledCost]
    seed: int = 0

    def __post_init__(self) -> None:
        check_speculation(self.acceptance_rate, self.num_speculative_tokens)

    def accepted_run(self, request: int, position: int) -> int:
        """G for `request` drafting at output `position`: accepted drafts before the first rejection (uncapped)."""
        a = self.acceptance_rate
        if a <= 0.0:
            return 0
        if a >= 1.0:
            return self.num_speculative_tokens
        word = _mix(_mix(_mix(self.seed & MASK) ^ (request & MASK)) ^ (position & MASK))
        u = ((word >> 11) + 1) / float(1 << 53)  # uniform on (0, 1]
        return int(math.log(u) / math.log(a))  # P(G >= j) = P(u <= a^j) = a^j

    def describe(self) -> dict:
        k, a = self.num_speculative_tokens, self.acceptance_rate
        return {"draft": self.draft, "acceptance_rate": a, "num_speculative_tokens": k,
                "expected_tokens_per_step": expected_tokens_per_step(a, k), "draft_cost": self.draft_cost.describe()}


class SpecStep:
    """One speculative step's shape, gathered sequence by sequence, and its price."""

    __slots__ = ("decode_seqs", "decode_ctx", "prefill_tokens", "prefill_pairs", "prefill_kv", "chunk_tokens",
                 "chunk_pairs", "chunk_kv", "rounds")

    def __init__(self) -> None:
        self.decode_seqs = self.decode_ctx = self.prefill_tokens = self.prefill_pairs = self.prefill_kv = 0
        self.chunk_tokens = self.chunk_pairs = self.chunk_kv = 0  # the real prompt chunks (the draft reads them too)
        self.rounds: list[list[int]] = []  # per draft round: [sequences, their total context]

    def chunk(self, computed: int, n: int) -> None:
        pairs = chunk_pairs(computed, n)
        self.prefill_tokens += n
        self.prefill_pairs += pairs
        self.prefill_kv += computed + n
        self.chunk_tokens += n
        self.chunk_pairs += pairs
        self.chunk_kv += computed + n

    def decode(self, computed: int) -> None:
        self.decode_seqs += 1
        self.decode_ctx += computed

    def verify(self, computed: int, drafts: int) -> None:
        """The target reads [last token, drafts] at `computed`; the draft ran `drafts` rounds before it."""
        n = 1 + drafts
        self.prefill_tokens += n
        self.prefill_pairs += chunk_pairs(computed, n)
        self.prefill_kv += computed + n
        rounds = self.rounds
        while len(rounds) < drafts:
            rounds.append([0, 0])
        for r in range(drafts):
            rounds[r][0] += 1
            rounds[r][1] += computed + r

    def seconds(self, cost, draft_cost) -> float:
        total = cost.seconds(self.decode_seqs, self.decode_ctx, self.prefill_tokens, self.prefill_pairs,
                             self.prefill_kv)
        rounds = self.rounds or ([[0, 0]] if self.chunk_tokens else [])
        for r, (rows, ctx) in enumerate(rounds):
            if r == 0:
                total += draft_cost.seconds(rows, ctx, self.chunk_tokens, self.chunk_pairs, self.chunk_kv)
            else:
                total += draft_cost.seconds(rows, ctx, 0, 0, 0)
        return total
