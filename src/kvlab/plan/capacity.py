"""KV-cache bytes per token, per sequence and per batch, and what fits in a budget.

Every figure is per tensor-parallel rank: each rank holds its share of KV heads (or the whole
MLA latent, which is replicated) and has its own memory budget.

State layers (linear attention, state-space mixers) hold a fixed state per sequence in the
model's dtype, whatever the context: they add bytes per sequence, never bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KVFormat, model_dtype_bytes, resolve_kv_format
from kvlab.plan.spec import LayerAttention, ModelSpec

# Binary searches for the longest context stop here: a model whose every layer is windowed
# has a bounded cache, and its longest context is unbounded.
CONTEXT_SEARCH_LIMIT = 1 << 40


@dataclass(frozen=True)
class CacheFormats:
    """The K and V storage formats (llama.cpp lets them differ; vLLM's one dtype sets both)."""

    k: KVFormat
    v: KVFormat
    state_bytes: int = 2  # bytes per element of a state layer's per-sequence state (the model dtype)

    @property
    def label(self) -> str:
        return self.k.name if self.k == self.v else f"K {self.k.name} / V {self.v.name}"


def cache_formats(
    kv_cache_dtype: str = "auto",
    k_dtype: Optional[str] = None,
    v_dtype: Optional[str] = None,
    model_dtype: str = "fp16",
    group_size: Optional[int] = None,
    residual: Optional[int] = None,
) -> CacheFormats:
    """Resolve `--kv-cache-dtype` with optional `--k-dtype`/`--v-dtype` overrides."""
    def resolve(name: str) -> KVFormat:
        return resolve_kv_format(name, model_dtype, group_size, residual)

    return CacheFormats(resolve(k_dtype or kv_cache_dtype), resolve(v_dtype or kv_cache_dtype),
                        model_dtype_bytes(model_dtype))


def kv_heads_per_rank(kv_heads: int, tensor_parallel: int) -> int:
    """KV heads one rank holds: a share when tp divides the heads, one replicated head when tp exceeds them."""
    if tensor_parallel <= 0:
        raise PlanError(f"--tensor-parallel-size must be positive, got {tensor_parallel}")
    if kv_heads % tensor_parallel and tensor_parallel % kv_heads:
        raise PlanError(f"{kv_heads} KV heads cannot be split over {tensor_parallel} ranks "
                        "(one must divide the other)")
    return max(1, kv_heads // tensor_parallel)


def state_bytes(layer: LayerAttention, formats: CacheFormats, tensor_parallel: int = 1) -> int:
    """Bytes of one sequence's state in a state layer, on one rank (its heads split like KV heads)."""
    if not layer.is_state:
        return 0
    heads = kv_heads_per_rank(layer.kv_heads, tensor_parallel)
    return layer.state_elements * heads // layer.kv_heads * formats.state_bytes


def layer_kv_bytes(layer: LayerAttention, tokens: int, formats: CacheFormats, tensor_parallel: int = 1) -> int:
    """Exact bytes one layer caches for one sequence of `tokens` tokens (window applied)."""
    if layer.kv_shared:
        return 0
    if layer.is_state:
        return state_bytes(layer, formats, tensor_parallel) if tokens > 0 else 0
    held = layer.cached_tokens(tokens)
    if layer.is_mla:
        return formats.k.bytes("k", 1, layer.latent_row, held)
    heads = kv_heads_per_rank(layer.kv_heads, tensor_parallel)
    return formats.k.bytes("k", heads, layer.k_head_dim, held) + formats.v.bytes("v", heads, layer.v_head_dim, held)


def layer_kv_bytes_per_token(layer: LayerAttention, formats: CacheFormats, tensor_parallel: int = 1) -> float:
    """Marginal bytes per token for one layer, ignoring its window (0 for state and shared layers)."""
    if layer.kv_shared or layer.is_state:
        return 0
    if layer.is_mla:
        return formats.k.bytes_per_token("k", 1, layer.latent_row)
    heads = kv_heads_per_rank(layer.kv_heads, tensor_parallel)
    return (formats.k.bytes_per_token("k", heads, layer.k_head_dim)
            + formats.v.bytes_per_token("v", heads, layer.v_head_dim))


def kv_fixed_bytes(spec: ModelSpec, formats: CacheFormats, tensor_parallel: int = 1) -> int:
    """Bytes a cache holds once per model on one rank, whatever its sequences: KVQuant's per-layer
    codebooks and key channel statistics (0 for every other format)."""
    total = 0
    for layer in spec.layers:
        if layer.kv_shared or layer.is_state or layer.is_mla:
            continue
        heads = kv_heads_per_rank(layer.kv_heads, tensor_parallel)
        total += formats.k.fixed_bytes("k", heads, layer.k_head_dim) + formats.v.fixed_bytes("v", heads, layer.v_head_dim)
    return total


def kv_bytes_per_token(spec: ModelSpec, formats: CacheFormats, tensor_parallel: int = 1) -> float:
    """Bytes per token over all layers while the context fits every window."""
    total = sum(layer_kv_bytes_per_token(layer, formats, tensor_parallel) for layer in spec.layers)
    return int(total) if float(total).is_integer() else total


def kv_bytes_per_sequence(spec: ModelSpec, context: int, formats: CacheFormats, tensor_parallel: int = 1) -> int:
    """Exact bytes for one sequence of `context` tokens, windowed layers capped."""
    if context < 0:
        raise PlanError(f"--context must be non-negative, got {context}")
    return sum(layer_kv_bytes(layer, context, formats, tensor_parallel) for layer in spec.layers)


def kv_cache_tokens(spec: ModelSpec, budget: int, formats: CacheFormats, tensor_parallel: int = 1) -> int:
    """Tokens a pooled cache of `budget` bytes holds, each token occupying every layer."""
    per_token = kv_bytes_per_token(spec, formats, tensor_parallel)
    return max(0, int(budget // per_token))


def seats(spec: ModelSpec, budget: int, context: int, formats: CacheFormats, tensor_parallel: int = 1) -> int:
    """Sequences of `context` tokens whose caches fit in `budget` bytes together."""
    per_sequence = kv_bytes_per_sequence(spec, context, formats, tensor_parallel)
    if per_sequence == 0:
        raise PlanError("a zero-token context holds no cache; give --context > 0")
    return max(0, budget // per_sequence)


def max_context(spec: ModelSpec, budget: int, batch: int, formats: CacheFormats,
                tensor_parallel: int = 1) -> Optional[int]:
    """Longest context each of `batch` sequences can have within `budget` (None: unbounded)."""
    if batch <= 0:
        raise PlanError(f"--batch must be positive, got {batch}")

    def fits(tokens: int) -> bool:
        return batch * kv_bytes_per_sequence(spec, tokens, formats, tensor_parallel) <= budget

    if fits(CONTEXT_SEARCH_LIMIT):
        return None
    low, high = 0, CONTEXT_SEARCH_LIMIT  # fits(low) is true (or budget < 0), fits(high) false
    if not fits(0):
        return 0
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low
