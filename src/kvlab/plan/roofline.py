"""Decode floor, prefill time and which limit binds, from bytes moved and FLOPs done.

Decode at small batch reads every (active) weight once per step plus each sequence's KV cache,
so its floor is bytes / bandwidth; at large batch the 2 FLOPs per active parameter per token
can take over. Prefill is compute: about 2 FLOPs per active parameter per prompt token plus
the attention term (QK^T and AV over the causal, window-capped prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvlab.plan.spec import CHUNKED, LayerAttention, ModelSpec

BANDWIDTH = "bandwidth"
COMPUTE = "compute"
MEMORY = "memory"


@dataclass(frozen=True)
class StepTime:
    seconds: float
    bound: str  # BANDWIDTH or COMPUTE


def causal_pairs(tokens: int, window: Optional[int]) -> int:
    """Query-key pairs a causal (optionally windowed) prefill of `tokens` tokens attends over."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def chunked_pairs(tokens: int, chunk: int) -> int:
    """Query-key pairs when each query attends causally within its own chunk (Llama 4's local layers)."""
    whole, rest = divmod(tokens, chunk)
    return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


def _pairs(layer: LayerAttention, tokens: int) -> int:
    if layer.is_state:
        return 0  # linear attention's work is in its projections, counted with the parameters
    if layer.kind == CHUNKED:
        return chunked_pairs(tokens, layer.window)
    return causal_pairs(tokens, layer.window)


def attention_flops(spec: ModelSpec, queries: int, keys_before: int, tensor_parallel: int = 1) -> int:
    """FLOPs of QK^T and AV for `queries` new tokens after `keys_before` cached ones (all layers, one rank)."""
    total = 0
    for layer in spec.layers:
        pairs = _pairs(layer, keys_before + queries) - _pairs(layer, keys_before)
        total += 2 * layer.q_heads * (layer.k_head_dim + layer.v_head_dim) * pairs
    return total // tensor_parallel


def decode_step(spec: ModelSpec, weight_bytes_read: int, kv_bytes_per_sequence: int, batch: int, context: int,
                bandwidth_gbs: float, tflops: float, tensor_parallel: int = 1) -> StepTime:
    """Time of one decode step for `batch` sequences at `context` tokens, on one rank."""
    bytes_moved = weight_bytes_read + batch * kv_bytes_per_sequence
    memory_seconds = bytes_moved / (bandwidth_gbs * 1e9)
    flops = batch * (2 * (spec.active_params or 0) // tensor_parallel
                     + attention_flops(spec, 1, max(context - 1, 0), tensor_parallel))
    compute_seconds = flops / (tflops * 1e12)
    if compute_seconds > memory_seconds:
        return StepTime(compute_seconds, COMPUTE)
    return StepTime(memory_seconds, BANDWIDTH)


def prefill_seconds(spec: ModelSpec, prompt_tokens: int, tflops: float, tensor_parallel: int = 1) -> float:
    """Compute-bound time to prefill one prompt of `prompt_tokens` tokens."""
    flops = 2 * (spec.active_params or 0) * prompt_tokens // tensor_parallel
    flops += attention_flops(spec, prompt_tokens, 0, tensor_parallel)
    return flops / (tflops * 1e12)
