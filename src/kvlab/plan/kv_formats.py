"""KV-cache storage formats and the exact bytes each one stores.

This module is the single source of truth for cache bytes: `kvlab.cache` stores its codes,
scales, zero points and full-precision residuals in exactly the shapes counted here, and
tests assert that the tensors it allocates sum to these figures byte for byte.

Conventions (chosen to match what the caches really hold):
- Float formats store one value per element. fp8's scale (per tensor or per head) is a
  static calibration constant held with the layer, not in the cache, as in vLLM; so fp8
  is exactly half of fp16.
- Group formats (int8/int4/int2) quantise each token's head vector in groups of
  `group_size` channels, asymmetric min-max, with an fp16 scale and an fp16 zero point per
  group. Codes are packed per token row: ceil(dim * bits / 8) bytes.
- KIVI formats (kivi2/kivi4) quantise keys per channel over groups of `group_size` tokens
  and values per token over groups of `group_size` channels (fp16 scale and zero point per
  group). The newest tokens stay in full precision: a sequence of T tokens holds
  max(0, (T - R) // G) * G quantised tokens and the rest (between R and R + G - 1 once
  T >= R) in the residual, stored in the model's dtype. R must be a multiple of G.
- KVQuant formats (kvquant3/kvquant4, Hooper et al., 2024) store each token's head vector as
  `bits`-bit indices into a per-layer non-uniform codebook (packed: ceil(dim * bits / 8) bytes)
  plus a sparse part of outliers kept in fp16 with their channel indices (one byte each up to
  256 channels, else two). Keys are normalised per channel by an offline range (KVQuant's
  pre-RoPE per-channel keys), so a key row holds no scale; its outliers are the values outside
  that range, as many in a token as it has (KVQuant's per-channel outlier thresholds), so they
  are stored as compressed sparse rows: a count per row (one byte, two past 255 channels) and
  a pool per head of `outlier_capacity(n, dim, percent)` = floor(n * dim * percent / 100)
  (value, channel) slots for n rows; a token may use the slots earlier tokens left free (never
  a later token's, so a token's outliers do not depend on how a prompt is chunked), and once
  the pool is full its least-out-of-range values are clipped instead. Values are
  normalised per token, so a value row adds an fp16 scale and zero point and keeps its
  `ceil(dim * percent / 100)` largest values as outliers (KVQuant's per-token outliers).
  The first `sink_tokens` tokens of a sequence (the attention sink) are kept whole in fp16.
  Per layer and side the cache also holds a fixed `fixed_bytes`: the fp16 codebook of 2**bits
  centroids, and for keys an fp16 per-channel zero and range for each head. Fixed bytes are
  per model, not per sequence: a pool pays them once.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.plan.errors import PlanError

FLOAT = "float"
GROUP = "group"
KIVI = "kivi"
KVQUANT = "kvquant"

SCALE_BYTES = 2  # fp16 scale per quantisation group
ZERO_BYTES = 2  # fp16 zero point per quantisation group
DEFAULT_GROUP_SIZE = 64  # transformers' QuantizedCache q_group_size
DEFAULT_KIVI_GROUP = 32  # KIVI paper
DEFAULT_KIVI_RESIDUAL = 128  # KIVI paper
DEFAULT_OUTLIER_PERCENT = 1  # KVQuant's dense-and-sparse split keeps 1% of values in fp16
DEFAULT_SINK_TOKENS = 1  # KVQuant keeps the first token (the attention sink) in fp16
SINK_BYTES = 2  # fp16 per value of a sink token
CODEBOOK_BYTES = 2  # fp16 per centroid
CHANNEL_STAT_BYTES = 2  # fp16 per-channel zero and range of pre-RoPE keys

_FLOAT_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
_CANONICAL = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "fp8": "fp8_e4m3"}
_GROUP_BITS = {"int8": 8, "int4": 4, "int2": 2}
_KIVI_BITS = {"kivi2": 2, "kivi4": 4}
_KVQUANT_BITS = {"kvquant3": 3, "kvquant4": 4}
MODEL_DTYPES = ("fp32", "fp16", "bf16")  # torch's for each: kvlab.cache.base.TORCH_DTYPES
ACTIVATION_DTYPES = ("fp32", "bf16")  # what kvlab's CPU models compute in: --dtype of generate, serve, bench
# The one table of cache format names: what `--kv-cache-dtype` accepts everywhere, and which path serves
# each. "lab": kvlab eval's caches (every format); "pool": the engine's paged pool (kvlab.cache.pool), so
# serve, generate, bench; "c_step": the pool formats the paged decode step runs in C (kvlab.nn.paged_decode,
# fp32 activations; int8/int4/int2 and KIVI in groups of a multiple of 8 channels; kvquant3/4 with their seats'
# sinks and outliers); the others decode module by module.
# "auto" is the model's dtype. KVQuant's formats need their calibration (`kvlab calibrate-kv`) wherever they run.
KV_CACHE_DTYPE_PATHS = {
    "auto": ("lab", "pool", "c_step"), "fp16": ("lab", "pool", "c_step"), "bf16": ("lab", "pool", "c_step"),
    "fp32": ("lab", "pool", "c_step"), "fp8": ("lab", "pool", "c_step"), "fp8_e4m3": ("lab", "pool", "c_step"),
    "fp8_e5m2": ("lab", "pool", "c_step"), "int8": ("lab", "pool", "c_step"), "int4": ("lab", "pool", "c_step"),
    "int2": ("lab", "pool", "c_step"), "kivi2": ("lab", "pool", "c_step"), "kivi4": ("lab", "pool", "c_step"),
    "kvquant3": ("lab", "pool", "c_step"), "kvquant4": ("lab", "pool", "c_step"),
}
KV_CACHE_DTYPES = tuple(KV_CACHE_DTYPE_PATHS)
POOL_KV_CACHE_DTYPES = tuple(name for name, paths in KV_CACHE_DTYPE_PATHS.items() if "pool" in paths)
C_STEP_KV_CACHE_DTYPES = tuple(name for name, paths in KV_CACHE_DTYPE_PATHS.items() if "c_step" in paths)


@dataclass(frozen=True)
class KVFormat:
    """How one side (K or V) of the cache is stored."""

    name: str
    scheme: str
    bits: int
    group_size: int = 0
    residual: int = 0
    residual_bytes: int = 2  # bytes per full-precision element (KIVI residual)
    outlier_percent: int = 0  # KVQuant: percent of each row's values kept in fp16 with their indices
    sink_tokens: int = 0  # KVQuant: a sequence's first tokens, kept whole in fp16

    @property
    def is_quantised(self) -> bool:
        return self.scheme != FLOAT

    def bytes(self, role: str, heads: int, dim: int, tokens: int) -> int:
        """Exact bytes to hold `tokens` tokens of `heads` heads of `dim` channels.

        `role` is "k" or "v": it matters only for KIVI, whose keys group along tokens.
        """
        if tokens < 0:
            raise PlanError(f"token count must be non-negative, got {tokens}")
        if self.scheme == FLOAT:
            return tokens * heads * dim * self.bits // 8
        codes_per_row = packed_row_bytes(dim, self.bits)
        if self.scheme == KVQUANT:
            sink = min(tokens, self.sink_tokens)
            rows = tokens - sink
            total = sink * heads * dim * SINK_BYTES + rows * heads * kvquant_row_bytes(dim, self.bits,
                                                                                        self.outlier_percent, role)
            if role == "k":
                total += heads * outlier_capacity(rows, dim, self.outlier_percent) * outlier_bytes(dim)
            return total
        if self.scheme == GROUP:
            return tokens * heads * (codes_per_row + groups_per_row(dim, self.group_size) * (SCALE_BYTES + ZERO_BYTES))
        quantised = kivi_quantised_tokens(tokens, self.group_size, self.residual)
        codes = quantised * heads * codes_per_row
        if role == "k":
            scales = (quantised // self.group_size) * heads * dim * (SCALE_BYTES + ZERO_BYTES)
        else:
            scales = quantised * heads * groups_per_row(dim, self.group_size) * (SCALE_BYTES + ZERO_BYTES)
        residual = (tokens - quantised) * heads * dim * self.residual_bytes
        return codes + scales + residual

    def fixed_bytes(self, role: str, heads: int, dim: int) -> int:
        """Bytes one layer's side holds whatever the tokens: KVQuant's codebook (and key channel stats)."""
        if self.scheme != KVQUANT:
            return 0
        stats = 2 * heads * dim * CHANNEL_STAT_BYTES if role == "k" else 0
        return (1 << self.bits) * CODEBOOK_BYTES + stats

    def bytes_per_token(self, role: str, heads: int, dim: int) -> float:
        """Marginal bytes per token far from the residual window and past KVQuant's sink tokens."""
        if self.scheme == KVQUANT:
            row = kvquant_row_bytes(dim, self.bits, self.outlier_percent, role)
            pool = dim * self.outlier_percent * outlier_bytes(dim) / 100 if role == "k" else 0
            per_token = heads * (row + pool)
            return int(per_token) if float(per_token).is_integer() else per_token
        if self.scheme != KIVI:
            return self.bytes(role, heads, dim, 1)
        codes = heads * packed_row_bytes(dim, self.bits)
        if role == "k":
            return codes + heads * dim * (SCALE_BYTES + ZERO_BYTES) / self.group_size
        return codes + heads * groups_per_row(dim, self.group_size) * (SCALE_BYTES + ZERO_BYTES)


def packed_row_bytes(dim: int, bits: int) -> int:
    """Bytes for one row of `dim` codes of `bits` bits, packed little-end-first into uint8."""
    return (dim * bits + 7) // 8


def outliers_per_row(dim: int, outlier_percent: int) -> int:
    """KVQuant's sparse values per row: ceil(dim * percent / 100), in integers."""
    return (dim * outlier_percent + 99) // 100


def outlier_index_bytes(dim: int) -> int:
    """Bytes of one outlier's channel index: uint8 up to 256 channels, else int16."""
    return 1 if dim <= 256 else 2


def outlier_bytes(dim: int) -> int:
    """One sparse outlier: its fp16 value and its channel index."""
    return 2 + outlier_index_bytes(dim)


def outlier_count_bytes(dim: int) -> int:
    """A key row's outlier count (compressed sparse rows): uint8 below 256 channels, else int16."""
    return 1 if dim < 256 else 2


def outlier_capacity(rows: int, dim: int, outlier_percent: int) -> int:
    """Outlier slots a KVQuant key pool holds for `rows` rows of one head: floor(rows * dim * percent / 100)."""
    return rows * dim * outlier_percent // 100


def kvquant_row_bytes(dim: int, bits: int, outlier_percent: int, role: str) -> int:
    """One KVQuant row's own bytes: packed codebook indices, then for a value row (normalised per
    token) its fp16 scale and zero and its ceil(dim * percent / 100) outliers, for a key row its
    outlier count (its outliers sit in the head's pool, counted by `outlier_capacity`)."""
    if role not in ("k", "v"):
        raise PlanError(f"role must be 'k' or 'v', got {role!r}")
    if role == "k":
        return packed_row_bytes(dim, bits) + outlier_count_bytes(dim)
    return packed_row_bytes(dim, bits) + SCALE_BYTES + ZERO_BYTES + outliers_per_row(dim, outlier_percent) * \
        outlier_bytes(dim)


def groups_per_row(dim: int, group_size: int) -> int:
    return (dim + group_size - 1) // group_size


def kivi_quantised_tokens(tokens: int, group_size: int, residual: int) -> int:
    """How many of a sequence's `tokens` a KIVI cache holds quantised (whole groups only)."""
    return max(0, (tokens - residual) // group_size) * group_size


def resolve_kv_format(
    name: str,
    model_dtype: str = "fp16",
    group_size: int | None = None,
    residual: int | None = None,
) -> KVFormat:
    """Turn a vLLM/llama.cpp-style name into a format; "auto" means the model's dtype."""
    key = (name or "auto").strip().lower()
    if key == "auto":
        key = model_dtype
    if model_dtype not in _FLOAT_BYTES:
        raise PlanError(f"unknown model dtype {model_dtype!r}; expected one of {MODEL_DTYPES}")
    if key in _FLOAT_BYTES:
        return KVFormat(_CANONICAL.get(key, key), FLOAT, 8 * _FLOAT_BYTES[key])
    if key in _GROUP_BITS:
        size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        _check_positive("--kv-group-size", size)
        return KVFormat(key, GROUP, _GROUP_BITS[key], group_size=size)
    if key in _KIVI_BITS:
        size = DEFAULT_KIVI_GROUP if group_size is None else group_size
        window = DEFAULT_KIVI_RESIDUAL if residual is None else residual
        _check_positive("--kv-group-size", size)
        if window < 0 or window % size:
            raise PlanError(f"KIVI residual {window} must be a non-negative multiple of the group size {size}")
        return KVFormat(key, KIVI, _KIVI_BITS[key], group_size=size, residual=window,
                        residual_bytes=_FLOAT_BYTES[model_dtype])
    if key in _KVQUANT_BITS:
        return KVFormat(key, KVQUANT, _KVQUANT_BITS[key], outlier_percent=DEFAULT_OUTLIER_PERCENT,
                        sink_tokens=DEFAULT_SINK_TOKENS)
    raise PlanError(f"unknown KV cache dtype {name!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")


def model_dtype_bytes(model_dtype: str) -> int:
    """Bytes per value of the model's own dtype (what state layers and KIVI residuals store)."""
    if model_dtype not in MODEL_DTYPES:
        raise PlanError(f"unknown model dtype {model_dtype!r}; expected one of {MODEL_DTYPES}")
    return _FLOAT_BYTES[model_dtype]


def _check_positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise PlanError(f"{flag} must be a positive integer, got {value!r}")

