"""One preallocated paged KV pool: every layer's K and V as blocks, allocated once, never moved.

The engine sizes the pool from a memory budget at start-up, as vLLM does, and then only
hands out block ids (kvlab.engine.block_manager); the pool itself knows no sequences. Tensors
never move after construction, so the C decode step can hold their addresses.

Layers are grouped by kind (kvlab.cache.kv_groups: full attention, sliding windows, a sinks +
window policy), each group with its own block tables, all drawing on one free list of block
ids, as in vLLM's hybrid KV-cache manager: the pool holds `group_size` tensor slots (the most
layers any group has) and layer i keeps its K/V in slot slot_of[i], so block b of slot j is a
page of whichever group owns block b. One group (every layer alike) is the case of one layer
per slot. An MLA model caches one latent row per token (kv_heads 1, `k_head_dim` the latent
plus its RoPE keys) and no V (`v_head_dim` 0).

Layout per slot and codec field: [num_blocks, kv_heads, block_size, width]. One head's
keys for a block are then `block_size x width` contiguous values, which is what an attention
loop over a sequence's tokens reads, block after block (vLLM's CPU backend uses the same
order). The bytes are kvlab.plan's: num_blocks x block_size tokens of the cache format in
each slot, which `tests/cache/test_pool.py` asserts byte for byte.
"""

from __future__ import annotations

import math
import mmap
from itertools import chain
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, model_dtype_name
from kvlab.cache.codecs import FloatCodec, RowCodec, Scale, make_codec
from kvlab.cache.kivi_pool import KiviPlanes
from kvlab.cache.kvquant_pool import KVQuantPlanes
from kvlab.cache.kv_groups import RELEASED, KVGroup, model_groups
from kvlab.plan.kv_formats import FLOAT, GROUP, KIVI, KVQUANT, KVFormat, resolve_kv_format
from kvlab.plan.pool_capacity import DEFAULT_BLOCK_SIZE  # noqa: F401 (kvlab.cache.pool.DEFAULT_BLOCK_SIZE)

Fields = dict[str, Tensor]  # codec field -> [num_blocks, kv_heads, block_size, width]


LAZY_ZEROS_BYTES = 1 << 20
# Tokens per block unless told otherwise (the engine, `kvlab serve`, `kvlab generate`'s pools).
# The C step reads one KV head's rows of a block as one run between jumps to wherever the next
# block sits; at 16 tokens (vLLM's GPU default) an int8 run is 1 KiB and on this project's
# CPUs int8 decode then ran only 1.19-1.35x fp16's speed at 4,096 tokens and 16 rows, at 64
# 1.42-1.50x, and fp16 itself 0.99-1.19x faster (`kvlab bench paged-decode`). vLLM's CPU
# backend defaults to 128 and warns below multiples of 32; 64 measured as fast as 128 and keeps
# prefix caching finer. (The number lives with the plan's arithmetic of the engine's pool.)


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
    """K and V storage for `num_blocks` blocks of `block_size` tokens, for layers grouped by `groups`."""

    def __init__(self, num_layers: int, kv_heads: int, k_head_dim: int, v_head_dim: int, num_blocks: int,
                 block_size: int, fmt: KVFormat, compute_dtype: torch.dtype = torch.float32,
                 k_scale: Scale = 1.0, v_scale: Scale = 1.0, device: torch.device | str | None = None,
                 groups: Optional[Sequence[KVGroup]] = None, seats: int = 0, calibration=None,
                 max_tokens: int = 0, pre_rope: bool = False) -> None:
        for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("k_head_dim", k_head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise CacheError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(v_head_dim, int) or v_head_dim < 0:
            raise CacheError(f"v_head_dim must be a non-negative integer (0: no values, MLA), got {v_head_dim!r}")
        if fmt.scheme not in (FLOAT, GROUP, KIVI, KVQUANT):
            raise CacheError(f"the paged pool stores fp32, fp16, bf16, fp8, int8, int4, int2, kivi2, kivi4, "
                             f"kvquant3 and kvquant4, not {fmt.name}")
        model_dtype_name(compute_dtype)
        self.groups = list(groups) if groups is not None else [KVGroup(tuple(range(num_layers)))]
        members = sorted(layer for group in self.groups for layer in group.layers)
        if members != list(range(num_layers)):
            raise CacheError(f"the groups must hold each of the {num_layers} layers once, got {members}")
        self.group_of, self.slot_of = [0] * num_layers, [0] * num_layers
        for index, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.group_of[layer], self.slot_of[layer] = index, slot
        self.num_layers, self.kv_heads, self.num_blocks, self.block_size = num_layers, kv_heads, num_blocks, block_size
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.kv_format, self.compute_dtype = fmt, compute_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        slots = max(len(group.layers) for group in self.groups)
        # KIVI's and KVQuant's storage: rows in blocks and state per seat (kivi_pool, kvquant_pool)
        self.seats, self.kivi, self.kvquant = seats, None, None
        # keys stored before RoPE (KVQuant's per-channel keys, or `kvlab eval --pre-rope-keys` in any row format):
        # attention rotates what the pool returns at the positions it holds (`attention_inputs`' rotate)
        self.pre_rope = fmt.scheme == KVQUANT or pre_rope
        if self.pre_rope and (fmt.scheme == KIVI or not v_head_dim):
            raise CacheError("pre-RoPE keys are stored by K/V pools in a per-token or KVQuant format (no KIVI, no MLA)")
        if fmt.scheme in (KIVI, KVQUANT):
            if not v_head_dim:
                raise CacheError(f"{fmt.name} pools hold K/V heads (no MLA latents)")
            if fmt.scheme == KIVI:
                if any(g.windowed and g.window <= fmt.residual + fmt.group_size for g in self.groups):
                    raise CacheError(f"a {fmt.name} pool's windows must be wider than its full-precision residual "
                                     f"of {fmt.residual + fmt.group_size} tokens")
                self.kivi = KiviPlanes(fmt, self.slot_of, num_blocks, block_size, kv_heads, k_head_dim, v_head_dim,
                                       seats, compute_dtype, self.device, zeroed)
            else:
                if k_head_dim != v_head_dim or (calibration is not None and len(calibration.layers) != num_layers):
                    raise CacheError(f"{fmt.name} pools hold equal K and V heads, with a calibration per layer")
                if any(g.sinks for g in self.groups):
                    raise CacheError(f"{fmt.name} pools keep their own sink tokens; --sink-tokens is not supported "
                                     "with them")
                self.kvquant = KVQuantPlanes(fmt, calibration, num_blocks, block_size, kv_heads, k_head_dim, seats,
                                             max_tokens or num_blocks * block_size, self.device, zeroed, self.slot_of)
            self.planes = self.kivi or self.kvquant
            self.codecs = (None, None)
            self.k = self.v = [None] * num_layers
            self._slots = []
            return
        self.planes = None
        self.codecs = (make_codec(fmt, k_head_dim, k_scale), make_codec(fmt, v_head_dim, v_scale) if v_head_dim else None)
        k_slots = [self._alloc(self.codecs[0]) for _ in range(slots)]
        v_slots = [self._alloc(self.codecs[1]) for _ in range(slots)] if v_head_dim else [None] * slots
        self.k = [k_slots[self.slot_of[layer]] for layer in range(num_layers)]
        self.v = [v_slots[self.slot_of[layer]] for layer in range(num_layers)]
        self._slots = k_slots + [fields for fields in v_slots if fields is not None]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
                  compute_dtype: torch.dtype = torch.float32, group_size: Optional[int] = None,
                  device: torch.device | str | None = None, kv_window: Optional[int] = None,
                  sink_tokens: int = 0, seats: int = 0, residual: Optional[int] = None, calibration=None,
                  max_tokens: int = 0, pre_rope: bool = False) -> "KVPool":
        """A pool for a kvlab.nn ModelConfig in the plan's format for `kv_cache_dtype`, its layers grouped
        as the plan groups them (kvlab.plan.vllm_groups.kv_groups), under an optional sinks + window policy."""
        fmt = resolve_kv_format(kv_cache_dtype, model_dtype_name(compute_dtype), group_size, residual)
        groups = model_groups(config.sliding_windows, layer_groups(config, block_size, kv_window, sink_tokens),
                              kv_window, sink_tokens)
        if config.attention == "mla":
            return cls(config.n_layers, 1, config.kv_lora_rank + config.rope_key_heads * config.qk_rope_head_dim, 0,
                       num_blocks, block_size, fmt, compute_dtype, device=device, groups=groups)
        return cls(config.n_layers, config.kv_heads, config.head_size, config.head_size, num_blocks, block_size, fmt,
                   compute_dtype, device=device, groups=groups, seats=seats, calibration=calibration,
                   max_tokens=max_tokens, pre_rope=pre_rope)

    def _alloc(self, codec: RowCodec) -> Fields:
        return {name: zeroed((self.num_blocks, self.kv_heads, self.block_size, width), dtype, self.device)
                for name, (width, dtype) in codec.fields().items()}

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def is_latent(self) -> bool:
        """An MLA pool: one latent row per token, no values."""
        return self.v_head_dim == 0

    def store(self, layer: int, k: Tensor, v: Optional[Tensor], step) -> None:
        """Store a step's new keys k [N, H, Dk] and values v [N, H, Dv] (None in an MLA pool) of layer
        `layer` where `step` (a kvlab.cache.StepBatch) places them."""
        group = self.group_of[layer]
        if self.planes is not None:
            self.planes.store(layer, k, v, [c - n for c, n in zip(step.context_lens, step.query_lens)],
                              step.query_lens, step.group_tables[group], step.seats)
            return
        self.write(layer, k, v, step.group_slots[group])

    def group(self, layer: int) -> KVGroup:
        return self.groups[self.group_of[layer]]

    def write(self, layer: int, k: Tensor, v: Optional[Tensor], slot_mapping: Tensor) -> None:
        """Store k [N, H, Dk] and v [N, H, Dv] (None in an MLA pool) at pool slots `slot_mapping` [N]
        (block x block_size + offset) of layer `layer`'s group."""
        if k.shape[0] != slot_mapping.numel() or (v is not None and v.shape[0] != slot_mapping.numel()):
            raise CacheError(f"{slot_mapping.numel()} slots for {k.shape[0]} keys")
        if (v is None) != self.is_latent:
            raise CacheError("an MLA pool stores latent rows alone; a K/V pool needs values too")
        slots = slot_mapping.to(self.device)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_tokens):
            raise CacheError(f"slot out of range for a pool of {self.num_tokens} token slots")
        blocks, offsets = slots // self.block_size, slots % self.block_size
        sides = ((self.k[layer], self.codecs[0], k), (self.v[layer], self.codecs[1], v))
        for fields, codec, x in sides[:1] if v is None else sides:
            encoded = codec.encode(x.transpose(0, 1)[None])  # [1, H, N, width]: codecs see rows per head
            for name, value in encoded.items():
                fields[name][blocks, :, offsets] = value[0].transpose(0, 1).to(self.device)

    def read(self, layer: int, block_table: Sequence[int], length: int) -> tuple[Tensor, Optional[Tensor]]:
        """A sequence's first `length` keys and values, [H, length, D] each, in the compute dtype
        (values None in an MLA pool); every block must be held."""
        need = -(-length // self.block_size)
        if need > len(block_table):
            raise CacheError(f"{length} tokens need {need} blocks, the table has {len(block_table)}")
        table = torch.as_tensor(list(block_table[:need]), dtype=torch.long, device=self.device)
        if need and int(table.min()) < 0:
            raise CacheError("the block table has released blocks: use read_held")
        return self._gather(layer, table, length)

    def read_held(self, layer: int, block_table: Sequence[int], length: int) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """Like `read`, skipping `RELEASED` entries: keys and values [H, held, D] and their positions [held]."""
        need = -(-length // self.block_size)
        if need > len(block_table):
            raise CacheError(f"{length} tokens need {need} blocks, the table has {len(block_table)}")
        logical = [b for b in range(need) if block_table[b] != RELEASED]
        table = torch.tensor([block_table[b] for b in logical], dtype=torch.long, device=self.device)
        positions = (torch.tensor(logical, dtype=torch.long)[:, None] * self.block_size
                     + torch.arange(self.block_size)[None, :]).flatten()
        keep = positions < length
        k, v = self._gather(layer, table, len(logical) * self.block_size)
        return k[:, keep], (v[:, keep] if v is not None else None), positions[keep]

    def attention_inputs(self, layer: int, step, s: int,
                         rotate=None) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """What sequence s of `step` attends over in layer `layer`: keys, values and a [new, held]
        mask, or None where plain causal attention over all its context is exact (a full group,
        or a window that hides nothing yet). A pre-RoPE pool's keys come back through
        `rotate(keys, positions)` (the layer's RoPE) at the positions they hold, as stored without it."""
        g = self.group_of[layer]
        table, new, context = step.group_tables[g][s], step.query_lens[s], step.context_lens[s]
        group = self.groups[g]
        need = -(-context // self.block_size)
        whole = RELEASED not in table[:need] and (group.window is None or context <= group.window)
        if self.planes is not None:
            seat = step.seats[s]
            if whole:
                keys, values = self.planes.read(layer, table, seat, context, self.compute_dtype)
            else:
                keys, values, held = self.planes.read_held(layer, table, seat, context, self.compute_dtype)
        elif whole:
            keys, values = self.read(layer, table, context)
        else:
            keys, values, held = self.read_held(layer, table, context)
        if self.pre_rope and rotate is not None:
            keys = rotate(keys, torch.arange(context) if whole else held)
        return keys, values, None if whole else group.visible(torch.arange(context - new, context), held)

    def _gather(self, layer: int, table: Tensor, length: int) -> tuple[Tensor, Optional[Tensor]]:
        def side(fields: Fields, codec: RowCodec) -> Tensor:
            rows = {name: f[table].transpose(0, 1).flatten(1, 2)[:, :length][None] for name, f in fields.items()}
            return codec.decode(rows, self.compute_dtype)[0]

        keys = side(self.k[layer], self.codecs[0])
        return keys, (side(self.v[layer], self.codecs[1]) if not self.is_latent else None)

    def float_planes(self, layer: int) -> Optional[tuple[Tensor, Tensor]]:
        """Layer `layer`'s K and V [num_blocks, H, block_size, D] when stored as plain floats (what C reads)."""
        if not self.is_latent and type(self.codecs[0]) is type(self.codecs[1]) is FloatCodec:
            return self.k[layer]["x"], self.v[layer]["x"]
        return None

    def tensors(self) -> Iterator[Tensor]:
        """Each tensor of the pool once (layers of different groups share a slot's tensors)."""
        if self.planes is not None:
            return self.planes.tensors()
        return chain.from_iterable(fields.values() for fields in self._slots)

    def nbytes(self) -> int:
        """Bytes of every tensor held: equal to the plan's bytes for num_blocks x block_size tokens."""
        return sum(t.nbytes for t in self.tensors())


def layer_groups(config, block_size: int, kv_window: Optional[int] = None, sink_tokens: int = 0) -> list[tuple[int, ...]]:
    """The layers of each KV group of a kvlab.nn ModelConfig, as the plan groups them (vLLM's hybrid
    rule): the layout depends on the layers' kinds and shapes, not on the cache format."""
    from kvlab.plan.capacity import cache_formats
    from kvlab.plan.vllm_groups import kv_groups
    from kvlab.plan.vllm_versions import DEFAULT_VERSION, release

    spec = config.to_plan_spec()
    if kv_window is not None:
        spec = spec.with_kv_window(kv_window, sink_tokens)
    groups = kv_groups(spec, cache_formats("fp16"), block_size, 1, True, release(DEFAULT_VERSION))
    if len({group.block_size for group in groups}) > 1:
        raise CacheError(f"{config.name}'s layers hold different bytes per token; the pool needs equal pages")
    return [group.layer_ids for group in groups]
