"""One preallocated paged KV pool: every layer's K and V as blocks, allocated once, never moved.

The engine sizes the pool from a memory budget at start-up, as vLLM does, and then only
hands out block ids (kvlab.engine.block_manager); the pool itself knows no sequences. Tensors
never move after construction, so the C decode step can hold their addresses.

Layout per layer and codec field: [num_blocks, kv_heads, block_size, width]. One head's
keys for a block are then `block_size x width` contiguous values, which is what an attention
loop over a sequence's tokens reads, block after block (vLLM's CPU backend uses the same
order). The bytes are kvlab.plan's: num_blocks x block_size tokens of the cache format,
which `tests/cache/test_pool.py` asserts byte for byte.
"""

from __future__ import annotations

import math
import mmap
from itertools import chain
from typing import Iterator, Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, model_dtype_name
from kvlab.cache.codecs import FloatCodec, RowCodec, Scale, make_codec
from kvlab.cache.step import RELEASED
from kvlab.plan.kv_formats import FLOAT, GROUP, KVFormat, resolve_kv_format

Fields = dict[str, Tensor]  # codec field -> [num_blocks, kv_heads, block_size, width]


LAZY_ZEROS_BYTES = 1 << 20
# Tokens per block unless told otherwise (the engine, `kvlab serve`, `kvlab generate`'s pools).
# The C step reads one KV head's rows of a block as one run between jumps to wherever the next
# block sits; at 16 tokens (vLLM's GPU default) an int8 run is 1 KiB and on this project's
# CPUs int8 decode then ran only 1.19-1.35x fp16's speed at 4,096 tokens and 16 rows, at 64
# 1.42-1.50x, and fp16 itself 0.99-1.19x faster (`kvlab bench paged-decode`). vLLM's CPU
# backend defaults to 128 and warns below multiples of 32; 64 measured as fast as 128 and keeps
# prefix caching finer.
DEFAULT_BLOCK_SIZE = 64


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor; a big CPU one on anonymous memory, which the OS zero-fills page by page on
    first touch: `torch.zeros` would write every byte of a gigabyte pool before the engine
    starts (seconds of SmolLM2's start-up), for pages most runs never reach."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or numel * itemsize < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, numel * itemsize)  # MAP_ANONYMOUS: zero pages, committed when written
    return torch.frombuffer(memory, dtype=dtype).view(shape)


class KVPool:
    """K and V storage for `num_blocks` blocks of `block_size` tokens in every layer."""

    def __init__(self, num_layers: int, kv_heads: int, k_head_dim: int, v_head_dim: int, num_blocks: int,
                 block_size: int, fmt: KVFormat, compute_dtype: torch.dtype = torch.float32,
                 k_scale: Scale = 1.0, v_scale: Scale = 1.0, device: torch.device | str | None = None) -> None:
        for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("k_head_dim", k_head_dim), ("v_head_dim", v_head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise CacheError(f"{name} must be a positive integer, got {value!r}")
        if fmt.scheme not in (FLOAT, GROUP):
            raise CacheError(f"the paged pool stores per-token formats (fp32, fp16, bf16, fp8, int8, int4, int2), "
                             f"not {fmt.name}: KIVI groups keys across tokens")
        model_dtype_name(compute_dtype)
        self.num_layers, self.kv_heads, self.num_blocks, self.block_size = num_layers, kv_heads, num_blocks, block_size
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.kv_format, self.compute_dtype = fmt, compute_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.codecs = (make_codec(fmt, k_head_dim, k_scale), make_codec(fmt, v_head_dim, v_scale))
        self.k = [self._alloc(self.codecs[0]) for _ in range(num_layers)]
        self.v = [self._alloc(self.codecs[1]) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
                  compute_dtype: torch.dtype = torch.float32, group_size: Optional[int] = None,
                  device: torch.device | str | None = None) -> "KVPool":
        """A pool for a kvlab.nn ModelConfig (grouped-query attention), in the plan's format for `kv_cache_dtype`."""
        if config.attention == "mla":
            raise CacheError("the paged pool holds K/V heads; MLA's latent cache is not paged yet")
        fmt = resolve_kv_format(kv_cache_dtype, model_dtype_name(compute_dtype), group_size)
        return cls(config.n_layers, config.kv_heads, config.head_size, config.head_size, num_blocks, block_size, fmt,
                   compute_dtype, device=device)

    def _alloc(self, codec: RowCodec) -> Fields:
        return {name: zeroed((self.num_blocks, self.kv_heads, self.block_size, width), dtype, self.device)
                for name, (width, dtype) in codec.fields().items()}

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def write(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store k [N, H, Dk] and v [N, H, Dv] at pool slots `slot_mapping` [N] (block x block_size + offset)."""
        if k.shape[0] != slot_mapping.numel() or v.shape[0] != slot_mapping.numel():
            raise CacheError(f"{slot_mapping.numel()} slots for {k.shape[0]} keys and {v.shape[0]} values")
        slots = slot_mapping.to(self.device)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_tokens):
            raise CacheError(f"slot out of range for a pool of {self.num_tokens} token slots")
        blocks, offsets = slots // self.block_size, slots % self.block_size
        for fields, codec, x in ((self.k[layer], self.codecs[0], k), (self.v[layer], self.codecs[1], v)):
            encoded = codec.encode(x.transpose(0, 1)[None])  # [1, H, N, width]: codecs see rows per head
            for name, value in encoded.items():
                fields[name][blocks, :, offsets] = value[0].transpose(0, 1).to(self.device)

    def read(self, layer: int, block_table: list[int], length: int) -> tuple[Tensor, Tensor]:
        """A sequence's first `length` keys and values, [H, length, D] each, in the compute dtype."""
        need = -(-length // self.block_size)
        if need > len(block_table):
            raise CacheError(f"{length} tokens need {need} blocks, the table has {len(block_table)}")
        table = torch.tensor(block_table[:need], dtype=torch.long, device=self.device)
        return (self._gather(self.k[layer], self.codecs[0], table, length),
                self._gather(self.v[layer], self.codecs[1], table, length))

    def read_held(self, layer: int, block_table: list[int], length: int) -> tuple[Tensor, Tensor, Tensor]:
        """Like `read`, skipping `RELEASED` entries: keys and values [H, held, D] and their positions [held]."""
        need = -(-length // self.block_size)
        if need > len(block_table):
            raise CacheError(f"{length} tokens need {need} blocks, the table has {len(block_table)}")
        logical = [b for b in range(need) if block_table[b] != RELEASED]
        table = torch.tensor([block_table[b] for b in logical], dtype=torch.long, device=self.device)
        positions = (torch.tensor(logical, dtype=torch.long)[:, None] * self.block_size
                     + torch.arange(self.block_size)[None, :]).flatten()
        keep = positions < length
        span = len(logical) * self.block_size
        return (self._gather(self.k[layer], self.codecs[0], table, span)[:, keep],
                self._gather(self.v[layer], self.codecs[1], table, span)[:, keep], positions[keep])

    def _gather(self, fields: Fields, codec: RowCodec, table: Tensor, length: int) -> Tensor:
        rows = {name: f[table].transpose(0, 1).flatten(1, 2)[:, :length][None] for name, f in fields.items()}
        return codec.decode(rows, self.compute_dtype)[0]

    def float_planes(self, layer: int) -> Optional[tuple[Tensor, Tensor]]:
        """Layer `layer`'s K and V [num_blocks, H, block_size, D] when stored as plain floats (what C reads)."""
        if type(self.codecs[0]) is type(self.codecs[1]) is FloatCodec:
            return self.k[layer]["x"], self.v[layer]["x"]
        return None

    def tensors(self) -> Iterator[Tensor]:
        return chain.from_iterable(fields.values() for fields in self.k + self.v)

    def nbytes(self) -> int:
        """Bytes of every tensor held: equal to the plan's bytes for num_blocks x block_size tokens."""
        return sum(t.nbytes for t in self.tensors())
