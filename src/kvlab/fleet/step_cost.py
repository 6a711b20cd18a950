"""What one engine step costs in seconds, from the shape of the batch it runs.

A step is summarised by five numbers (StepShape): decoding sequences and the context they
attend over, prefill tokens fed, the query-key pairs of those prefill chunks, and the KV tokens
they read. Two models price it:

- RooflineCost (the default): the planner's roofline (kvlab.plan.roofline) for a whole mixed
  step, bytes moved (active weights once, plus each token's KV) against FLOPs done (2 per active
  parameter per token plus attention), each divided by its peak times an efficiency factor,
  plus a fixed per-step overhead (kernel launches, scheduling, sampling).
- LinearCost (from `kvlab fleet calibrate`): fitted on the real engine, with two regimes as
  the engine runs them: a pure decode step (kvlab's fused paged decode) and any step that
  feeds a prompt chunk (the model run module by module over every token of the step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Defaults when no calibration is given. They are assumptions, stated so they can be replaced:
DEFAULT_BANDWIDTH_EFFICIENCY = 0.70  # achieved / datasheet HBM bandwidth in memory-bound decode
DEFAULT_COMPUTE_EFFICIENCY = 0.50  # achieved / datasheet dense TFLOP/s in prefill (MFU)
DEFAULT_STEP_OVERHEAD_S = 0.002  # per engine step: scheduling, launches, sampling, detokenising
EFFICIENCY_SOURCES = {
    "bandwidth": "Databricks, 'LLM Inference Performance Engineering: Best Practices' (2023): model bandwidth "
                 "utilisation of about 60-70% for batch-1 decode on A100/H100 with TensorRT-LLM (recall, not "
                 "re-checked here); 0.70 taken",
    "compute": "prefill MFU of 40-60% is the range engines report for large GEMMs on H100 (recall); 0.50 taken",
    "overhead": "vLLM's per-step CPU overhead of a few ms motivated its V1 rewrite and async scheduling "
                "(recall); 2 ms taken",
}


@dataclass(frozen=True)
class StepShape:
    decode_seqs: int = 0
    decode_ctx: int = 0  # sum over decoding sequences of tokens already cached
    prefill_tokens: int = 0
    prefill_pairs: int = 0  # causal query-key pairs of the prefill chunks (with their cached context)
    prefill_kv: int = 0  # KV tokens the prefill chunks read and write


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs of a chunk of `n` tokens after `start` cached ones (causal)."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class RooflineCost:
    """Roofline seconds per step on one tensor-parallel rank (all ranks run the same step)."""

    weight_bytes_read: float  # active weights per rank
    kv_bytes_per_token: float  # per rank
    flops_per_token: float  # 2 x active parameters / tp
    attention_flops_per_pair: float  # sum over layers of 2 x q_heads x (dk + dv) / tp
    bandwidth_gbs: float
    tflops: float
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    kind: str = "roofline"

    def seconds(self, decode_seqs: int, decode_ctx: int, prefill_tokens: int, prefill_pairs: int,
                prefill_kv: int) -> float:
        tokens = decode_seqs + prefill_tokens
        if tokens == 0:
            return 0.0
        moved = self.weight_bytes_read + self.kv_bytes_per_token * (decode_ctx + decode_seqs + prefill_kv)
        flops = self.flops_per_token * tokens + self.attention_flops_per_pair * (decode_ctx + decode_seqs
                                                                                  + prefill_pairs)
        memory = moved / (self.bandwidth_gbs * 1e9 * self.bandwidth_efficiency)
        compute = flops / (self.tflops * 1e12 * self.compute_efficiency)
        return self.step_overhead_s + max(memory, compute)

    def describe(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LinearCost:
    """Seconds per step fitted on the real engine (two regimes: pure decode, and steps with prefill)."""

    decode_base: float
    decode_per_seq: float
    decode_per_ctx: float
    mixed_base: float
    mixed_per_token: float
    mixed_per_pair: float
    kind: str = "calibrated"

    def seconds(self, decode_seqs: int, decode_ctx: int, prefill_tokens: int, prefill_pairs: int,
                prefill_kv: int) -> float:
        if prefill_tokens == 0:
            if decode_seqs == 0:
                return 0.0
            return self.decode_base + self.decode_per_seq * decode_seqs + self.decode_per_ctx * decode_ctx
        return (self.mixed_base + self.mixed_per_token * (prefill_tokens + decode_seqs)
                + self.mixed_per_pair * (prefill_pairs + decode_ctx + decode_seqs))

    def describe(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LinearCost":
        names = ("decode_base", "decode_per_seq", "decode_per_ctx", "mixed_base", "mixed_per_token", "mixed_per_pair")
        return cls(*(float(data[name]) for name in names))
