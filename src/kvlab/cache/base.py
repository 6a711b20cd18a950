"""What every cache shares: the shape it was built for, per-layer token counts, byte accounting.

Attention modules talk to one interface, `KVCache.update`, whatever the storage behind it
(preallocated, paged, group-quantised, KIVI). `update` is written once here: subclasses only
say how to store new tokens (`_store`) and how to read all of them back (`_load`), so the
pre-RoPE option and the checks behave the same in every cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from kvlab.errors import KvlabError
from kvlab.plan.kv_formats import KVFormat

Rope = Callable[[Tensor, Tensor], Tensor]  # rope(x [B, H, T, D], positions [T]) -> x rotated
# The one table of dtype names (kvlab.plan.kv_formats.MODEL_DTYPES) and their torch dtypes: what --dtype,
# "auto" caches and the float codecs mean by fp32, fp16 and bf16 (kvlab's CPU models compute in
# kvlab.plan.kv_formats.ACTIVATION_DTYPES).
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMPUTE_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class CacheError(KvlabError):
    """Misuse of a cache (wrong shape, full cache, unsupported option): a caller's mistake."""


def model_dtype_name(compute_dtype: torch.dtype) -> str:
    """The plan's name for a compute dtype ("auto" KV caches and KIVI residuals use its bytes)."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise CacheError(f"compute dtype must be one of {list(COMPUTE_DTYPES)}, got {compute_dtype}")
    return COMPUTE_DTYPES[compute_dtype]


@dataclass(frozen=True)
class KVShape:
    """The sizes a K/V cache is built for; the batch advances together, one row per sequence."""

    num_layers: int
    batch: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    max_tokens: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value <= 0:
                raise CacheError(f"{name} must be a positive integer, got {value!r}")


class CacheStore:
    """Per-layer token counts, `nbytes` over the tensors held, and `reset`."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._lengths = [0] * num_layers

    def seq_len(self, layer_idx: int = 0) -> int:
        """Tokens stored so far in layer `layer_idx`."""
        return self._lengths[self._layer(layer_idx)]

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor the cache holds (codes, scales, zero points, residuals, buffers)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of every tensor held: tests compare this with kvlab.plan, byte for byte."""
        return sum(t.nbytes for t in self.tensors())

    def reset(self) -> None:
        """Forget every token (growing and paged caches also release their storage)."""
        self._lengths = [0] * self.num_layers
        self._clear()

    def _clear(self) -> None:
        raise NotImplementedError

    def _layer(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self.num_layers:
            raise CacheError(f"layer_idx {layer_idx} out of range for a {self.num_layers}-layer cache")
        return layer_idx


class KVCache(CacheStore):
    """Keys and values per layer, [B, H_kv, T, D], returned in the compute dtype for attention.

    With `pre_rope` the attention passes keys before RoPE (KVQuant): quantisation then sees
    the raw channels, whose outliers sit in fixed channels, and the cache applies `rope` at
    positions 0..T-1 after dequantising. `rope` is one function, or one per layer for a model
    whose layers rotate with different tables (Gemma 3's sliding and global layers).
    """

    kv_format: Optional[KVFormat] = None  # the plan's format, set by make_cache

    def __init__(self, shape: KVShape, compute_dtype: torch.dtype = torch.float32, pre_rope: bool = False,
                 rope: Union[Rope, Sequence[Rope], None] = None, device: torch.device | str | None = None) -> None:
        super().__init__(shape.num_layers)
        model_dtype_name(compute_dtype)
        if pre_rope and rope is None:
            raise CacheError("pre_rope=True needs a rope(x, positions) function to apply on read")
        if isinstance(rope, (list, tuple)) and len(rope) != shape.num_layers:
            raise CacheError(f"one rope function per layer: got {len(rope)} for {shape.num_layers} layers")
        self.shape = shape
        self.compute_dtype = compute_dtype
        self.pre_rope = pre_rope
        self.rope = rope
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k [B, H, T_new, Dk] and v [B, H, T_new, Dv]; return all keys and values so far.

        The results may be views of the cache's storage: read them, do not write into them.
        """
        layer = self._layer(layer_idx)
        self._check(k, self.shape.k_head_dim, "k")
        self._check(v, self.shape.v_head_dim, "v")
        if k.shape[2] != v.shape[2]:
            raise CacheError(f"k has {k.shape[2]} new tokens but v has {v.shape[2]}")
        start = self._lengths[layer]
        end = start + k.shape[2]
        if end > self.shape.max_tokens:
            raise CacheError(f"layer {layer} would hold {end} tokens, over max_tokens={self.shape.max_tokens}")
        self._store(layer, start, k, v)
        self._lengths[layer] = end
        keys, values = self._load(layer, end)
        if self.pre_rope:
            rope = self.rope[layer] if isinstance(self.rope, (list, tuple)) else self.rope
            keys = rope(keys, torch.arange(end, device=keys.device))
        return keys.to(self.compute_dtype), values.to(self.compute_dtype)

    def window_mask(self, layer_idx: int, new_tokens: int) -> Optional[Tensor]:
        """The [new, held] mask of the last `update`'s queries, for a cache that drops tokens; None:
        plain causal (every cache that keeps all its tokens)."""
        return None

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        raise NotImplementedError

    def _load(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _check(self, x: Tensor, dim: int, name: str) -> None:
        want = (self.shape.batch, self.shape.kv_heads, dim)
        if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != want:
            raise CacheError(f"{name} must be [batch={want[0]}, kv_heads={want[1]}, T_new, {dim}], "
                             f"got {list(x.shape)}")
