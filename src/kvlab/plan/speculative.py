"""Speculative decoding's arithmetic: what a draft costs in memory, and what it should buy in speed.

Memory: the draft's weights sit beside the target's, and its K/V beside the target's in the
same pool. Caching both for every token is the same as caching one model with both models'
layers, so the KV figures (bytes per token, seats, longest context) are the target's with the
draft's layers appended (`with_draft`), and the engine's shared pool holds
budget // (target + draft bytes per block) blocks, each addressing both caches.

Speed (Leviathan, Kalman and Matias, 2022): with acceptance rate a and k drafted tokens, a
step emits (1 - a^(k+1)) / (1 - a) tokens on average, and costs k draft steps plus one target
verification; with c the draft step's cost relative to the target's, the expected speed-up
over plain decoding is (1 - a^(k+1)) / ((1 - a)(k c + v)), where v, the verification's cost
relative to a plain step, is 1 where batch-1 decode is bound by reading the weights (a GPU):
k + 1 rows cost what one does. Where the arithmetic per row is not small beside the weight
reads (on 2 CPU cores each extra row of a SmolLM2 step costs a tenth to a quarter of it), v
is measured (kvlab.bench.speculative) and passed in, and `acceptance_needed` says what a
target speed-up then asks of the draft.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from kvlab.plan.capacity import CacheFormats, kv_bytes_per_sequence
from kvlab.plan.errors import PlanError
from kvlab.plan.spec import ModelSpec


def with_draft(target: ModelSpec, draft: ModelSpec) -> ModelSpec:
    """The target's spec with the draft's attention layers appended: what the shared cache holds per token."""
    return replace(target, name=f"{target.name}+{draft.name}", layers=target.layers + draft.layers)


def shared_pool_blocks(target: ModelSpec, draft: ModelSpec, budget: int, formats: CacheFormats,
                       block_size: int, tensor_parallel: int = 1) -> tuple[int, int, int]:
    """(blocks, target bytes per block, draft bytes per block) of a pool where every block holds both caches.

    `budget` and the bytes are per tensor-parallel rank (both models' KV heads split over the ranks).
    """
    target_block = kv_bytes_per_sequence(target, block_size, formats, tensor_parallel)
    draft_block = kv_bytes_per_sequence(draft, block_size, formats, tensor_parallel)
    return max(0, budget) // (target_block + draft_block), target_block, draft_block


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """Tokens one speculative step emits on average: 1 + a + a^2 + ... + a^k."""
    check_speculation(acceptance_rate, k)
    if acceptance_rate == 1.0:
        return float(k + 1)
    return (1 - acceptance_rate ** (k + 1)) / (1 - acceptance_rate)


def expected_speedup(acceptance_rate: float, k: int, cost_ratio: float, verify_cost: float = 1.0,
                     draft_passes: Optional[int] = None) -> float:
    """Expected tokens per step over the step's relative cost: k draft steps at `cost_ratio` each (or
    `draft_passes` of them: a Medusa head set drafts all k in one), plus the verification of k + 1 tokens
    at `verify_cost` plain steps (1 where decode is bound by weight reads)."""
    if cost_ratio < 0:
        raise PlanError(f"the draft's relative cost must be non-negative, got {cost_ratio}")
    if verify_cost <= 0:
        raise PlanError(f"--verify-cost must be positive, got {verify_cost}")
    passes = k if draft_passes is None else draft_passes
    return expected_tokens_per_step(acceptance_rate, k) / (passes * cost_ratio + verify_cost)


def acceptance_needed(speedup: float, k: int, cost_ratio: float, verify_cost: float = 1.0,
                      draft_passes: Optional[int] = None) -> Optional[float]:
    """The smallest acceptance rate at which `expected_speedup` reaches `speedup`; None when even a draft
    that is always accepted falls short ((k + 1) tokens per step over the step's cost)."""
    if expected_speedup(1.0, k, cost_ratio, verify_cost, draft_passes) < speedup:
        return None
    if expected_speedup(0.0, k, cost_ratio, verify_cost, draft_passes) >= speedup:
        return 0.0
    low, high = 0.0, 1.0  # expected_speedup rises with the acceptance rate
    for _ in range(60):
        middle = (low + high) / 2
        if expected_speedup(middle, k, cost_ratio, verify_cost, draft_passes) >= speedup:
            high = middle
        else:
            low = middle
    return high


def check_speculation(acceptance_rate: float, k: int) -> None:
    """The acceptance rate and drafted tokens every speculative figure accepts (plan and fleet alike)."""
    if not 0 <= acceptance_rate <= 1:
        raise PlanError(f"--acceptance-rate must be in [0, 1], got {acceptance_rate}")
    if not isinstance(k, int) or k < 1:
        raise PlanError(f"--num-speculative-tokens must be a positive integer, got {k!r}")
